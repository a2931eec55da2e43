#!/usr/bin/env bash
# Wheels of exactly what the lent GPU machine's image lacks for `import streamckpt`, the GPU tests
# and the GPU benchmark (issue 26), fetched HERE (that machine reaches no registry) into .whl/:
#
#   make gpu-wheels                                      # cp312 for the image, into .whl/
#   bash benchmarks/gpu_wheels.sh --python-version 3.11 --dest /tmp/whl311   # this machine's Python
#
# The image (the device tool's KINDS.md, read 2026-11-17) has Python 3.12, torch 2.11, numpy, fsspec,
# safetensors, pyyaml, tqdm, psutil, pytest, pytest-timeout, hypothesis, aiohttp, wrapt, urllib3,
# python-dateutil, multidict, yarl; it lacks the pyproject dependencies below and what they need.
# Pinned to the versions this project's .venv runs. The pip command is the device README's.
# One version of each, --no-deps: every needed distribution is named here. Total ~25 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=3.12
DEST=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYVER="$2"; shift 2 ;;
    --dest) DEST="$2"; shift 2 ;;
    *) echo "usage: $0 [--python-version 3.12] [--dest .whl]" >&2; exit 2 ;;
  esac
done
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WHEELS=(
  zstandard==0.25.0      # streamckpt: zstd frames (imported by formats at import time)
  crc32c==2.9.post0      # streamckpt: CRC32C of every data file
  xxhash==4.1.0          # streamckpt: content digests (incremental saves); the image has one, this pins ours
  obstore==0.12.1        # streamckpt: Rust S3 reads
  s3fs==2026.9.0         # streamckpt: S3 writes and fallback reads
  fsspec==2026.9.0       # s3fs pins fsspec to its own version; the image's may differ
  aiobotocore==3.10.0    # s3fs
  botocore==1.43.117     # aiobotocore (within its pin)
  jmespath==1.1.0        # botocore
  aioitertools==0.13.0   # aiobotocore
)
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"
# Keep one version of each (an older download left in DEST would stop the install on the device).
keep=$(printf '%s\n' "${WHEELS[@]}" | sed 's/#.*//; s/ *$//; s/==/-/; s/[-_.]\+/_/g' | tr 'A-Z' 'a-z')
for f in "$DEST"/*.whl; do
  stem=$(basename "$f" | cut -d- -f1-2 | sed 's/[-_.]\+/_/g' | tr 'A-Z' 'a-z')
  echo "$keep" | grep -qx "$stem" || { echo "removing stale $f"; rm -f "$f"; }
done
ls -1 "$DEST"
du -sh "$DEST"
