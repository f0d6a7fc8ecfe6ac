#!/usr/bin/env bash
# CUDA 12: compiles every shipped spec's forward kernel for sm_80 and sm_90
# with NVRTC 12 (NVIDIA's nvidia-cuda-nvrtc-cu12 wheel, installed once into
# target/pypi-nvrtc12), for the machines whose driver is CUDA 12. The wheel's
# library is the only NVRTC on the loader's path here, and `flashgen check`
# must report it. Usage: scripts/nvrtc12-check.sh [path/to/flashgen]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
flashgen="${1:-${CARGO_TARGET_DIR:-$root/target}/debug/flashgen}"
pypi="$root/target/pypi-nvrtc12"
lib="$pypi/nvidia/cuda_nvrtc/lib"
if [ ! -e "$lib/libnvrtc.so.12" ]; then
    echo "flashgen: installing nvidia-cuda-nvrtc-cu12 from PyPI into target/pypi-nvrtc12" >&2
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$pypi" 'nvidia-cuda-nvrtc-cu12>=12.4,<13'
fi
for spec in "$root"/specs/*.attn; do
    for arch in sm_80 sm_90; do
        # No toolkit's or workspace's NVRTC 13 in reach: the check must find 12.
        out=$(env -u CUDA_PATH -u CUDA_HOME -u VIRTUAL_ENV -u CONDA_PREFIX LD_LIBRARY_PATH="$lib" \
            FLASHGEN_CACHE=off "$flashgen" check "$spec" --arch "$arch" 2>&1) || { echo "$out"; exit 1; }
        grep -q "with NVRTC 12\." <<<"$out" || { echo "not NVRTC 12: $out"; exit 1; }
    done
done
echo "NVRTC 12: every shipped spec compiles for sm_80 and sm_90"
