"""Decode step time at 1 and 32 streams in this process (run it with and without
THP_MEM_ALLOC_ENABLE=1, alternating; thp_ab.sh). Prints one JSON line."""
import json, os, statistics, sys, time
sys.path.insert(0, "/work/main")
import torch
torch.set_num_threads(1)
from stages.engine.engine import EngineConfig, LLMEngine
from stages.protocol import SamplingParams

eng = LLMEngine.from_config(EngineConfig(num_kv_blocks=4096, num_threads=1))

def run(streams, tokens=40):
    for i in range(streams):
        eng.add_request(f"s{i}-{time.perf_counter()}", [100 + (i * 7 + j) % 5000 for j in range(32)],
                        SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    walls = []
    while eng.has_unfinished():
        t0 = time.perf_counter(); eng.step(); walls.append(time.perf_counter() - t0)
    return statistics.mean(walls[-(tokens - 4):]) * 1e3

run(4)
out = {"thp": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"),
       "anon_huge_kb": int([l for l in open("/proc/self/smaps_rollup") if "AnonHuge" in l][0].split()[1])}
for b in (1, 32):
    out[f"b{b}_ms"] = statistics.median(run(b) for _ in range(3))
print(json.dumps(out), flush=True)
