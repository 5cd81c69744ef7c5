import torch, time, statistics, torch.nn.functional as F
for th in (1, 2):
    torch.set_num_threads(th)
    for rows in (32, 406):
        gu = torch.randn(rows, 3072); x = torch.randn(rows, 576); r = torch.randn(rows, 576); w = torch.randn(576)
        def swiglu():
            g, u = gu.split(1536, -1); return F.silu(g) * u
        def addnorm():
            y = x + r; return F.rms_norm(y, (576,), w, 1e-5), y
        for name, fn in (("silu*mul", swiglu), ("add+rmsnorm", addnorm)):
            for _ in range(20): fn()
            ts = []
            for _ in range(200):
                t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
            print(f"threads {th} rows {rows} {name}: {statistics.median(ts)*1e6:.0f} us  (x30 layers: {statistics.median(ts)*30e3*(1 if name[0]=='s' else 2):.1f} ms)")
