import sys, time, statistics, torch, ctypes
sys.path.insert(0, "/work/main")
from stages.engine.kernels import PagedDecodeAttention
ks = [PagedDecodeAttention(ctypes.CDLL(p)) for p in sys.argv[1:]]
import os
B, H, KVH, D, bs = int(os.environ.get("B", 32)), 9, 3, 64, 16
torch.manual_seed(0)
for ctx in (80, 170):
    nblk = -(-ctx // bs)
    for dt in (torch.float32, torch.bfloat16):
        slots = 22000
        layers = [(torch.randn(slots, KVH, D).to(dt), torch.randn(slots, KVH, D).to(dt)) for _ in range(30)]
        tables = torch.randperm(slots // bs)[: B * nblk].view(B, nblk).int().contiguous()
        lens = torch.randint(ctx // 2, ctx + 1, (B,), dtype=torch.int32)
        q = torch.randn(B, H, D)
        outs, times = [], []
        for k in ks:
            def run(): return [k(q, kc, vc, tables, lens, bs, 0.125, 1) for kc, vc in layers]
            run(); ts = []
            for _ in range(8):
                t0 = time.perf_counter(); o = run(); ts.append(time.perf_counter() - t0)
            outs.append(o); times.append(statistics.median(ts))
        err = max((a - b).abs().max().item() for a, b in zip(outs[0], outs[-1]))
        print(ctx, dt, " ".join(f"{t*1e3:.2f} ms" for t in times), f"ratio {times[-1]/times[0]:.2f} maxdiff {err:.1e}")
