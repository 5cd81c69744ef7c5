"""Time spent in RMSNorm per 32-sequence decode step, in the engine (wrapper timing, no profiler)."""
import os, sys, time, statistics
sys.path.insert(0, os.environ.get("ROOT", "/work/main"))
from stages.engine.engine import EngineConfig, LLMEngine
from stages.engine.models import llama
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.protocol import SamplingParams
tok = load_tokenizer(EMBEDDED_MODEL)
eng = LLMEngine.from_config(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=4096, num_threads=1, prefill_threads=2))
spent = []
orig = llama.RMSNorm.forward
def timed(self, x):
    t0 = time.perf_counter(); y = orig(self, x); spent.append(time.perf_counter() - t0); return y
llama.RMSNorm.forward = timed
sp = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
for i in range(32):
    eng.add_request(f"r{i}", tok(f"Write a detailed essay about topic {i}:", add_special_tokens=False).input_ids, sp)
for _ in range(5):
    eng.step()
per_step, walls = [], []
for _ in range(40):
    spent.clear(); t0 = time.perf_counter(); eng.step(); walls.append(time.perf_counter() - t0); per_step.append(sum(spent))
print("norm calls per step", len(spent), "norm ms per step median", round(statistics.median(per_step) * 1e3, 2),
      "per call us", round(statistics.median(per_step) / len(spent) * 1e6, 1), "step ms", round(statistics.median(walls) * 1e3, 1))
