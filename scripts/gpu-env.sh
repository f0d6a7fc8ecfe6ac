# Sourced by the pack's scripts on a GPU machine (scripts/gpu-pack.sh copies
# it there as env.sh): `here`, the pack; `out`, where logs go ($OUT, else
# ./gpu-logs), created; the CUDA libraries on the loader's path; `ncu`.
here="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
out="${OUT:-$here/gpu-logs}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
