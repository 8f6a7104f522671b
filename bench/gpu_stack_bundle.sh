#!/usr/bin/env bash
# `make gpu-stack-bundle`: what a GPU node lacks to run the whole stack (bench/gpu_stack.sh,
# ADR 0028), in one file for the device tool to carry: .cache/gpu-stack.tar.xz with
#   wheels/  the packages the router, the target and Redis's client import that the node's image
#            does not have, at this venv's versions, for CPython 3.12 on manylinux x86-64;
#   bin/, lib/  redis-server, and the libraries of it outside a bare image (jemalloc, lzf, atomic);
#   stubs/v1  the generated gRPC stubs (gitignored).
# Not in it: Ray (79 MB; the target runs in a plain process there) and grpcio (7.4 MB; the node
# has one). It prints each part's size and what is left of what a call can carry beside the tree.
set -eu
py=${PYTHON:-.venv/bin/python}
dir=.cache/gpu-stack
rm -rf "$dir" && mkdir -p "$dir/wheels" "$dir/bin" "$dir/lib" "$dir/stubs"
names="protobuf pydantic_core hiredis grpcio-health-checking grpcio-reflection redis pydantic pydantic-settings
python-dotenv annotated-types typing-inspection typing_extensions fastapi starlette annotated-doc uvicorn
opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions"
pins=$($py -m pip list --format=freeze 2>/dev/null | tr 'A-Z' 'a-z' | tr '_' '-' > "$dir/freeze.txt";
  for n in $names; do m=$(echo "$n" | tr 'A-Z' 'a-z' | tr '_' '-'); grep -m1 "^$m==" "$dir/freeze.txt"; done)
$py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64 -d "$dir/wheels" $pins 2>&1 \
  | grep -v "^WARNING: Location" || true
exe=$(readlink -f "$(command -v redis-server || echo /usr/bin/redis-server)")
cp "$exe" "$dir/bin/redis-server"
for lib in libjemalloc.so.2 liblzf.so.1 libatomic.so.1; do
  path=$(ldd "$exe" | awk -v l="$lib" '$1 == l {print $3}')
  [ -n "$path" ] && cp -L "$path" "$dir/lib/"
done
cp -r src/specserve/v1 "$dir/stubs/v1" && rm -rf "$dir/stubs/v1/__pycache__"
tar -C "$dir" -cJf .cache/gpu-stack.tar.xz wheels bin lib stubs
tracked=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
bundle=$(du -b .cache/gpu-stack.tar.xz | cut -f1)
echo "wheels $(du -cb "$dir"/wheels/* | tail -1 | cut -f1) B ($(ls "$dir/wheels" | wc -l) files), redis-server" \
  "$(du -b "$dir/bin/redis-server" | cut -f1) B, libraries $(du -cb "$dir"/lib/* | tail -1 | cut -f1) B, stubs" \
  "$(du -sb "$dir/stubs" | cut -f1) B"
echo "bundle .cache/gpu-stack.tar.xz $bundle B; tracked tree $tracked B; left of 64 MiB:" \
  "$((67108864 - tracked - bundle)) B"
[ $((tracked + bundle)) -le 67108864 ] || { echo "the bundle does not fit beside the tree" >&2; exit 1; }
