import sys, ctypes, time, statistics, subprocess, torch
sys.path.insert(0, "/work/main")
from pathlib import Path
from stages.engine.kernels import QuantMatmul
from stages.engine.quant import pack_q4_1, pack_q8_0
FL = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-fno-math-errno"]
def load(src, tag):
    src, *defs = src.split(":")
    out = f"/tmp/w/{tag}.so"; subprocess.run(["g++", *FL, *[f"-D{d}" for d in defs], src, "-o", out], check=True); return QuantMatmul(ctypes.CDLL(out))
srcs = sys.argv[1:] or ["/work/main/stages/engine/kernels/quant_matmul.cpp"]
ks = [load(s, f"k{i}") for i, s in enumerate(srcs)]
torch.manual_seed(0)
def q41(n, k):
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8); d = torch.rand(n, k // 32) * 0.01; m = -torch.rand(n, k // 32) * 0.05
    return pack_q4_1(q, d, m)
def q80(n, k):
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8); d = torch.rand(n, k // 32) * 0.001
    return pack_q8_0(q, d)
shapes = [("qkv", 576, 960), ("o", 576, 576), ("gu", 576, 3072), ("down", 1536, 576)]
W = {name: q41(n, k) for name, k, n in shapes}
LM = q80(49152, 576)
def t(fn, rep):
    fn(); ts = []
    for _ in range(rep):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
import os; TH = int(os.environ.get("TH", "1"))
for M in [int(v) for v in os.environ.get('MS','1,4,8,32,384').split(',')]:
    x = {k: torch.randn(M, k) for k in (576, 1536)}
    res = []
    outs = []
    for kern in ks:
        def layer():
            o = []
            for name, k, n in shapes:
                wq, wd, wm = W[name]
                o.append(kern.q4_1(x[k], wq, wd, wm, n, TH))
            return o
        rep = 30 if M < 64 else 5
        tl = t(layer, rep) * 30  # 30 layers
        outs.append(layer())
        lm = None
        if M <= 32:
            lm = t(lambda: kern.q8_0(x[576], LM[0], LM[1], 49152, 1), 5)
            outs[-1].append(kern.q8_0(x[576], LM[0], LM[1], 49152, 1))
        flops = 30 * sum(2 * M * k * n for _, k, n in shapes)
        res.append(f"linears {tl*1e3:7.2f} ms {flops/tl/1e9:5.0f} GOP/s" + (f" lm {lm*1e3:6.2f} ms" if lm else ""))
    diff = ""
    if len(outs) > 1:
        diff = " maxrel " + " ".join(f"{max(((a-b).abs().max()/(a.abs().max()+1e-9)).item() for a,b in zip(outs[0], o)):.1e}" for o in outs[1:])
    print(f"M={M:3d} | " + " | ".join(res) + diff, flush=True)
