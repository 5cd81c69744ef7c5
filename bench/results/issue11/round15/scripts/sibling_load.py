"""Is the second vCPU a sibling of the step thread's? The engine's 32-stream decode step, pinned to
CPU 1, with CPU 0 idle, spinning a pure-ALU loop (no memory traffic), at a 30% duty of that loop,
or streaming memory. If the pure-ALU spin slows the step, the two vCPUs share one core's execution
units (SMT) and any work the stages do costs the step thread directly."""
import multiprocessing as mp, os, statistics, sys, time
sys.path.insert(0, "/work/main")

def spin(kind, stop):
    os.sched_setaffinity(0, {0})
    if kind == "mem":
        import numpy as np
        a = np.ones(16 << 20); b = np.empty_like(a)
    x = 1
    while not stop.is_set():
        if kind == "alu":
            for _ in range(100000): x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        elif kind == "duty30":
            t = time.perf_counter()
            while time.perf_counter() - t < 0.003: x = (x * 1103515245 + 12345) & 0xFFFFFFFF
            time.sleep(0.007)
        elif kind == "mem":
            np.copyto(b, a)

def main():
    os.sched_setaffinity(0, {1})
    import torch
    torch.set_num_threads(1)
    from stages.engine.engine import EngineConfig, LLMEngine
    from stages.protocol import SamplingParams
    eng = LLMEngine.from_config(EngineConfig(num_kv_blocks=4096, num_threads=1))
    def run():
        for i in range(32):
            eng.add_request(f"s{i}-{time.time()}", [100 + (i * 7 + j) % 5000 for j in range(32)],
                            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        walls = []
        while eng.has_unfinished():
            t0 = time.perf_counter(); eng.step(); walls.append(time.perf_counter() - t0)
        return statistics.mean(walls[-30:]) * 1e3
    run()
    kinds = os.environ.get("KINDS", "none,alu,duty30,mem").split(",")
    res = {k: [] for k in kinds}
    for r in range(int(os.environ.get("ROUNDS", "4"))):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            stop = mp.Event(); p = None
            if k != "none":
                p = mp.Process(target=spin, args=(k, stop)); p.start(); time.sleep(0.3)
            res[k].append(run())
            if p: stop.set(); p.join()
            print(k, round(res[k][-1], 1), flush=True)
    base = statistics.median(res["none"])
    for k in kinds:
        print(f"{k}: median {statistics.median(res[k]):.1f} ms/step, x{statistics.median(res[k]) / base:.3f}")

if __name__ == "__main__":
    main()
