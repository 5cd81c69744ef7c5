"""Where a burst's prompt step goes, in-process: the serve_config engine (1 thread, prefill on 2,
budget 512), 32 chat prompts at once; each step's wall time split into the block-quantised matmuls
(by row count), the attention (SDPA for prompts, paged kernel for decodes) and the rest."""
import os, sys, time, statistics, collections, resource
sys.path.insert(0, os.environ.get("ROOT", "/work/main"))
import torch
import torch.nn.functional as F
from stages.engine.engine import EngineConfig, LLMEngine
from stages.engine import kernels
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.protocol import SamplingParams

TOPICS = ["rivers", "volcanoes", "bridges", "bees", "libraries", "glaciers", "trains", "forests"]
tok = load_tokenizer(EMBEDDED_MODEL)
def prompt(i, r):
    msgs = [{"role": "user", "content": f"Write a detailed essay about {TOPICS[i % 8]} number {i} (round {r}):"}]
    return tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
extra = dict(a.split("=") for a in sys.argv[1:] if "=" in a)
cfg = EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=2048, **{k: (int(v) if v.isdigit() else {"true": True, "false": False}.get(v, v)) for k, v in extra.items()})
eng = LLMEngine.from_config(cfg)
acc = collections.Counter()
qm = kernels.quant_matmul()
for name in ("q4_1", "q8_0"):
    orig = getattr(qm, name)
    def wrap(*a, _orig=orig, _name=name, **k):
        t0 = time.perf_counter(); r = _orig(*a, **k); acc[f"{_name}"] += time.perf_counter() - t0
        acc["rows"] = max(acc["rows"], a[0].shape[0]); return r
    setattr(qm, name, wrap)
sdpa = F.scaled_dot_product_attention
def sdpa_w(*a, **k):
    t0 = time.perf_counter(); r = sdpa(*a, **k); acc["sdpa"] += time.perf_counter() - t0; return r
F.scaled_dot_product_attention = sdpa_w
pk = kernels.PagedDecodeAttention.__call__
def pk_w(self, *a, **k):
    t0 = time.perf_counter(); r = pk(self, *a, **k); acc["paged"] += time.perf_counter() - t0; return r
kernels.PagedDecodeAttention.__call__ = pk_w
sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
eng.add_request("w", prompt(0, -1), sp)
while eng.has_unfinished(): eng.step()
print("prompt len", len(prompt(0, 0)), "threads", cfg.num_threads, "prefill_threads", cfg.prefill_threads)
rows = collections.defaultdict(list)
for r in range(int(extra.get("rounds", 5)) if False else 5):
    for i in range(32): eng.add_request(f"r{r}-{i}", prompt(i, r), sp)
    s = 0
    while eng.has_unfinished():
        acc.clear(); f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; t0 = time.perf_counter(); eng.step(); wall = time.perf_counter() - t0
        acc["faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        rows[s].append((wall, dict(acc))); s += 1
for s, lst in rows.items():
    w = statistics.median(x[0] for x in lst) * 1e3
    parts = {k: statistics.median(x[1].get(k, 0) for x in lst) * 1e3 for k in ("q4_1", "q8_0", "sdpa", "paged")}
    faults = statistics.median(x[1].get("faults", 0) for x in lst)
    print(f"step {s}: rows {statistics.median(x[1].get('rows', 0) for x in lst):.0f} wall {w:.0f} ms  " + "  ".join(f"{k} {v:.0f}" for k, v in parts.items()) + f"  rest {w - sum(parts.values()):.0f}  minor faults {faults:.0f}")
