#!/usr/bin/env bash
# The whole stack on a GPU node (issue 52 item 5, ADR 0028) as one prepared call: the node has
# python3 with torch, transformers, grpcio, numpy and tokenizers, but no Ray, no Redis and no
# package index. What it lacks travels in one bundle, `make gpu-stack-bundle` here:
#   .cache/gpu-stack.tar.xz   the wheels below (cp312 manylinux or pure), redis-server and the
#                             libraries of it a bare image may lack, and the generated gRPC stubs
# and the device tool carries it (carry: [".cache/gpu-stack.tar.xz"]). The target runs in a plain
# process, not under Ray (its wheel, 79 MB, does not fit what a node can be given).
#   bash bench/gpu_stack.sh                      # on the node: unpack, check, run gpu_stack.py
#   bash bench/gpu_stack.sh --smoke --device cpu # anywhere: the same path on the CPU
# Results go to ${OUT:-bench/results/gpu}/stack.
set -u
out=${OUT:-bench/results/gpu}/stack
mkdir -p "$out" && out=$(cd "$out" && pwd)
bundle=${GPU_STACK_BUNDLE:-.cache/gpu-stack.tar.xz}
py=${PYTHON:-python3}
if [ -f "$bundle" ]; then
  work=${GPU_STACK_DIR:-/tmp/specserve-gpu-stack}
  mkdir -p "$work" && tar -C "$work" -xJf "$bundle" || exit 1
  # the stubs were generated here from proto/ (gitignored, so they travel in the bundle)
  [ -f src/specserve/v1/__init__.py ] || cp -r "$work/stubs/v1" src/specserve/v1 || exit 1
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
    "$work"/wheels/*.whl || exit 1
  export PYTHONPATH=$work/site PATH=$work/bin:$PATH LD_LIBRARY_PATH=$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # the node's own grpcio serves when it is at least the stubs' version (grpcio's 7 MB wheel does
  # not fit beside the rest); an older one is named here, and the stubs' import fails on it
  $py - <<'EOF'
import grpc, re
from pathlib import Path
need = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", Path("src/specserve/v1/target_pb2_grpc.py").read_text())[1]
print(f"grpcio {grpc.__version__} (the stubs need >= {need})")
EOF
fi
export PYTHONPATH=$PWD/src:$PWD/bench${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
  TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false RAY_USAGE_STATS_ENABLED=0
command -v redis-server >/dev/null || { echo "gpu_stack.sh: no redis-server (make gpu-stack-bundle packs one)" >&2; exit 1; }
redis-server --version || { echo "gpu_stack.sh: redis-server does not run here:" >&2; ldd "$(command -v redis-server)" >&2; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout "${GPU_STACK_S:-420}" $py bench/gpu_stack.py --out "$out" "$@" 2>&1 | grep -v "^\[transformers\]" \
  | tee "$out/gpu_stack.log"
exit "${PIPESTATUS[0]}"
