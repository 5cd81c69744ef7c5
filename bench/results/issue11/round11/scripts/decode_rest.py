"""Where a 32-sequence decode step's time goes outside the kernels: cProfile of steps (Python
functions, cumulative) and the torch profiler's op table, in-process with serve_config's engine."""
import cProfile, os, pstats, sys, time, statistics
sys.path.insert(0, os.environ.get("ROOT", "/work/main"))
import torch
from stages.engine.engine import EngineConfig, LLMEngine
from stages.model_info import EMBEDDED_MODEL, load_tokenizer
from stages.protocol import SamplingParams
tok = load_tokenizer(EMBEDDED_MODEL)
eng = LLMEngine.from_config(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=2048, num_threads=1, prefill_threads=2))
sp = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
for i in range(32):
    ids = tok(f"Write a detailed essay about topic {i}:", add_special_tokens=False).input_ids
    eng.add_request(f"r{i}", ids, sp)
for _ in range(5):
    eng.step()
ts = []
for _ in range(30):
    t0 = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t0)
print("decode step ms median", round(statistics.median(ts) * 1e3, 1))
pr = cProfile.Profile(); pr.enable()
for _ in range(20):
    eng.step()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(5):
        eng.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
