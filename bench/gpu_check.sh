#!/usr/bin/env bash
# make gpu-check's device half, runnable as one prepared call on a GPU node that has torch,
# transformers and numpy but no package index (ADR 0016, 0019): the node's own python3 with
# src/ and bench/ on its path. Results go to ${OUT:-bench/results/gpu}.
set -u
out=${OUT:-bench/results/gpu}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
py=${PYTHON:-python3}
# the code that ran, as a digest of its sources (a copied tree's .git may not be this commit's):
# `find src bench -name '*.py' | sort | xargs cat | sha1sum` on a checkout gives the same
echo "sources $(find src bench -name '*.py' -not -path '*/__pycache__/*' | sort | xargs cat | sha1sum | cut -c1-12)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader
$py -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# issue 51's figures in one call (<= 8 minutes on an H200): the workers' default arm in full (plain,
# the draft model host-driven and inside the round, the EAGLE head in the round with its trees,
# greedy identity of head rounds on the demo pair), the fused layers' plain decoding beside it;
# then the engine loop (the head in the round, remote blocks pre-drafted, the controller)
timeout "${GPU_CHECK_S:-300}" $py bench/gpu_check.py --models models --out "$out" ${GPU_CHECK_ARGS:---graphs layer,layer+fused --streams 1,16 --alphas 0.8} 2>&1 \
  | grep -v "^\[transformers\]" | tee "$out/gpu_check.log"
[ "${ENGINE_LOOP_S:-170}" = 0 ] || (cd bench && timeout "${ENGINE_LOOP_S:-170}" $py bench_engine_loop.py --profiles real --device cuda --model 1b \
  --streams ${ENGINE_LOOP_STREAMS:-1,16,64} --arms ${ENGINE_LOOP_ARMS:-plain,K=4,adaptive,eagle:K=4,eagle:adaptive} --tokens 32 --real-draft-ms ${REAL_DRAFT_MS:-0.5} --out "$out/loop" 2>&1 | tail -24 \
  | tee "$out/engine_loop.log")
