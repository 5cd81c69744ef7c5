import os, sys, subprocess, time
pids = [int(p) for p in sys.argv[1].split(',')]
def snap():
    out = {}
    for pid in pids:
        for tid in os.listdir(f'/proc/{pid}/task'):
            try:
                comm = open(f'/proc/{pid}/task/{tid}/comm').read().strip()
                st = open(f'/proc/{pid}/task/{tid}/stat').read().rsplit(')',1)[1].split()
                out[(pid,int(tid))] = (comm, int(st[11]) + int(st[12]))
            except Exception: pass
    return out
a = snap(); t=time.time(); subprocess.run(sys.argv[2:]); b = snap(); dt=time.time()-t
tick = os.sysconf('SC_CLK_TCK')
rows = sorted(((c - a.get(k, (n, 0))[1]) / tick, k, n) for k, (n, c) in b.items())
print(f"wall {dt:.1f}")
for d, k, n in reversed(rows[-14:]):
    if d > 0.02: print(f"{d:6.2f}s pid {k[0]} tid {k[1]} {n}")
