#!/bin/bash
# the controller arm with the built-in policy: all pools (new) vs the default pool alone (old, as a stored `default`)
cd /work/main
for i in 1 2; do
  for v in new old; do
    if [ $v = old ]; then export SPECSERVE_ROUTER_POLICIES='{"default": {"draft_pool": "small", "k": 4}}'; else unset SPECSERVE_ROUTER_POLICIES; fi
    .venv/bin/python bench/bench_peer.py --models models --out /tmp/peer-$v-$i --no-vllm --no-inprocess --exact-batching invariant > /tmp/peer-$v-$i.log 2>&1
    echo "$v $i done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
