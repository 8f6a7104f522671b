#!/bin/bash
cd /work/main
while pgrep -f ctrl_ab.sh >/dev/null; do sleep 5; done
for i in 1 2; do
  export SPECSERVE_ROUTER_POLICIES='{"default": {"draft_pool": "small", "draft_pools": ["ngram"], "adaptive_k": true, "k_min": 1, "k_max": 8}}'
  .venv/bin/python bench/bench_peer.py --models models --out /tmp/peer-adapt-$i --no-vllm --no-inprocess --exact-batching invariant > /tmp/peer-adapt-$i.log 2>&1
  echo "adapt $i done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
done
