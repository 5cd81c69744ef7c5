import sys, os, time, statistics, torch, collections
sys.path.insert(0, os.environ.get("ROOT", "/work/main"))
from stages.engine.engine import EngineConfig, LLMEngine
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.protocol import SamplingParams
from stages.engine import quant
import stages.engine.models.llama as L
import torch.nn.functional as F
tok = load_tokenizer(EMBEDDED_MODEL)
T = ["rivers","volcanoes","bridges","bees","libraries","glaciers","trains","forests"]
def prompt(i, r):
    m=[{"role":"user","content":f"Write a detailed essay about {T[i%8]} number {i} (round {r}):"}]
    return tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
eng = LLMEngine.from_config(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=2048, num_threads=1))
acc = collections.defaultdict(float)
def timed(key, f):
    def g(*a, **k):
        t0=time.perf_counter(); r=f(*a, **k); acc[key]+=time.perf_counter()-t0; return r
    return g
orig_qm = quant.QuantLinear.quant_matmul
def qm(self, x):
    t0=time.perf_counter(); r=orig_qm(self, x); acc["lm_head" if self.out_features > 10000 else "linears(kernel)"] += time.perf_counter()-t0; return r
quant.QuantLinear.quant_matmul = qm
quant.QuantLinear.forward = timed("linears(+casts)", quant.QuantLinear.forward)
L.RMSNorm.forward = timed("rmsnorm", L.RMSNorm.forward)
L.Attention.forward = timed("attention(all)", L.Attention.forward)
L.MLP.forward = timed("mlp(all)", L.MLP.forward)
L._apply_rope = timed("rope", L._apply_rope)
L.F = type("F", (), {})()
for n in dir(F):
    if not n.startswith("_"): setattr(L.F, n, getattr(F, n))
L.F.scaled_dot_product_attention = timed("sdpa", F.scaled_dot_product_attention)
L.F.silu = timed("silu", F.silu)
r = eng.runner
r.execute = timed("execute", r.execute); r.prepare = timed("prepare", r.prepare)
r.model.forward = timed("model.forward", r.model.forward)
sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
eng.add_request("w", prompt(0, -1), sp)
while eng.has_unfinished(): eng.step()
walls = []
for rnd in range(4):
    for i in range(32): eng.add_request(f"{rnd}-{i}", prompt(i, rnd), sp)
    if rnd == 1: acc.clear()
    t0=time.perf_counter(); eng.step(); walls.append(time.perf_counter()-t0)
    while eng.has_unfinished(): eng.step()
n = 3
print("burst step ms", [round(w*1e3) for w in walls])
for k,v in sorted(acc.items(), key=lambda kv:-kv[1]): print(f"  {k:22s} {v/n*1e3:7.2f} ms (incl. the 2nd token step)")
