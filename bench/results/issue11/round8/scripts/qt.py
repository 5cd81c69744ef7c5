import sys, ctypes, time, statistics, torch
sys.path.insert(0, "/work/main")
from stages.engine.kernels import QuantMatmul
k = QuantMatmul(ctypes.CDLL(sys.argv[1]))
for M in (32, 384):
  for K in (576, 1536):
    x = torch.randn(M, K)
    k.quantize_activations(x)
    ts=[]
    for _ in range(20):
        t0=time.perf_counter(); k.quantize_activations(x); ts.append(time.perf_counter()-t0)
    print(M, K, f"{statistics.median(ts)*1e6:.0f} us  {statistics.median(ts)/(M*K)*1e9:.2f} ns/elem")
