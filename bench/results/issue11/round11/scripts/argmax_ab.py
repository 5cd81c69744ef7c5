"""A/B in one process: 32-sequence greedy decode steps with the argmax kernel and with torch's
argmax, alternating (6 × 30 steps each); the engine as serve_config sets it."""
import os, sys, time, statistics
sys.path.insert(0, os.environ.get("ROOT", "/work/main"))
from stages.engine.engine import EngineConfig, LLMEngine
from stages.engine.sampler import _torch_argmax
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.protocol import SamplingParams
tok = load_tokenizer(EMBEDDED_MODEL)
eng = LLMEngine.from_config(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=4096, num_threads=1, prefill_threads=2))
kernel = eng.runner.sampler._argmax
assert kernel is not _torch_argmax, "no kernel built here"
sp = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
for i in range(32):
    eng.add_request(f"r{i}", tok(f"Write a detailed essay about topic {i}:", add_special_tokens=False).input_ids, sp)
for _ in range(5):
    eng.step()
spent = []
def timed(fn):
    def run(x):
        t0 = time.perf_counter(); out = fn(x); spent.append(time.perf_counter() - t0); return out
    return run
kernel_t, torch_t = timed(kernel), timed(_torch_argmax)
res = {"kernel": [], "torch": []}
arg = {"kernel": [], "torch": []}
for rnd in range(6):
    for name in (("kernel", "torch") if rnd % 2 == 0 else ("torch", "kernel")):
        eng.runner.sampler._argmax = kernel_t if name == "kernel" else torch_t
        ts = []
        spent.clear()
        for _ in range(30):
            t0 = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t0)
        res[name].append(statistics.median(ts) * 1e3)
        arg[name].append(statistics.median(spent) * 1e3)
for k, v in res.items():
    print(k, "step ms per round", [round(x, 1) for x in v], "median", round(statistics.median(v), 1))
for k, v in arg.items():
    print(k, "argmax ms per step, per round", [round(x, 2) for x in v], "median", round(statistics.median(v), 2))
print("ratio kernel/torch per round", [round(a / b, 3) for a, b in zip(res["kernel"], res["torch"])])
