#!/bin/bash
# restart.sh CONFIG : stop serve, start with CONFIG from /work/main, wait healthy
pkill -TERM -f "serve run" ; sleep 3; /work/main/.venv/bin/ray stop --force >/dev/null 2>&1; sleep 1
(nohup /tmp/serve_dir.sh /work/main "$1" > /tmp/serve_wt.log 2>&1 &)
for i in $(seq 1 90); do sleep 1; curl -sf localhost:8000/health >/dev/null && { echo "healthy after $i s"; exit 0; }; done
echo "not healthy"; tail -20 /tmp/serve_wt.log; exit 1
