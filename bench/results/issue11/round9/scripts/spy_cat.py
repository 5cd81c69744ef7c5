import collections, sys
cat=collections.Counter(); tot=0; ours=collections.Counter()
rules=[('stages/','ours'),('starlette/','starlette'),('uvicorn/','uvicorn'),('ray/serve/_private/router','serve-router'),('request_router','serve-router'),('ray/serve/_private/replica_result','serve-result'),('ray/serve/_private/replica.py','serve-replica'),('ray/serve/_private/http_util','serve-http'),('ray/util/metrics','ray-metrics'),('ray/serve/metrics','serve-metrics'),('grpc/','grpc'),('cloudpickle','pickle'),('serialization','pickle'),('opentelemetry','otel'),('trace/__init__','otel'),('asyncio/','asyncio'),('anyio','anyio'),('logging/','logging'),('json/','json'),('pydantic','pydantic'),('prometheus','prometheus'),('ray/serve','serve-other'),('ray/','ray-other')]
for line in open(sys.argv[1]):
    stack,n=line.rsplit(' ',1); n=int(n)
    frames=[f for f in stack.split(';') if f.strip()]
    if not frames: continue
    leaf=frames[-1]
    if any(k in leaf for k in ('select (selectors','epoll','wait (threading.py')): continue
    tot+=n
    c='native/other'
    for f in reversed(frames):
        hit=[name for pat,name in rules if pat in f]
        if hit: c=hit[0]; break
    cat[c]+=n
    for f in frames:
        if 'stages/' in f: ours[f[:110]]+=n
print(tot)
for k,v in cat.most_common(): print(f"{v:6d} {100*v/tot:5.1f}% {k}")
print('--- our frames inclusive')
for k,v in ours.most_common(int(sys.argv[2]) if len(sys.argv)>2 else 25): print(v,k)
