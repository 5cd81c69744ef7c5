import glob, json, sys
steps=[]
for p in glob.glob('/tmp/r6/probe/*.log'):
    for line in open(p):
        rid,name,t=line.split()
        if name=='STEP':
            _,t0,dur,nseq,ntok,nw=rid.split('-'); steps.append((float(t0),float(dur),int(nseq),int(ntok),int(nw)))
steps.sort()
client=json.load(open('/tmp/burst_client.json'))
for b in client[-int(sys.argv[1]):]:
    t0=b['t0']; tt=sorted(b['ttfts']); print(f"burst: ttft p50 {tt[16]*1e3:.0f} p95 {tt[30]*1e3:.0f} max {tt[-1]*1e3:.0f}")
    for s in steps:
        if t0 <= s[0] <= t0+1.0 and s[3] > 32: print(f"  start {1e3*(s[0]-t0):7.1f} ms  dur {1e3*s[1]:6.1f}  seqs {s[2]:3d} tokens {s[3]:4d} waiting-before {s[4]}")
