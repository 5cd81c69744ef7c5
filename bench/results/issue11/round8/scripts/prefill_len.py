import sys, os, time, statistics
sys.path.insert(0, "/work/main")
from stages.engine.engine import EngineConfig, LLMEngine
from stages.model_info import EMBEDDED_MODEL
from stages.protocol import SamplingParams
import random
lim = int(sys.argv[1])
eng = LLMEngine.from_config(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=4096, max_model_len=8192, num_threads=1,
      prefill_kernel_max_len=lim, max_num_batched_tokens=2048, enable_prefix_caching=False))
sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
rng = random.Random(0)
res = {}
for L, n in [tuple(int(v) for v in x.split("x")[::-1]) for x in os.environ.get("SIZES", "8x64,4x128,2x256,1x512,1x1024,1x2000").split(",")]:
    ts = []
    for rep in range(int(os.environ.get("REPS", 4))):
        for i in range(n): eng.add_request(f"{L}-{rep}-{i}", [rng.randrange(100, 40000) for _ in range(L)], sp)
        t0 = time.perf_counter()
        while eng.has_unfinished(): eng.step()
        ts.append(time.perf_counter() - t0)
    res[f"{n}x{L}"] = round(statistics.median(ts[1:]) * 1e3, 1)
print(lim, res)
