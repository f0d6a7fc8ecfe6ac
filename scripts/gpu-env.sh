# Sourced by the pack's scripts on a GPU machine (scripts/gpu-pack.sh copies
# it there as env.sh): `here`, the pack (where this file is); `out`, where
# logs go ($OUT, else ./gpu-logs), created; the CUDA libraries and NCCL on
# the loader's path; `ncu`; FlashAttention-4 on python's path where it is
# installed.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The pack's binaries travel as one xz stream (gpu-pack.sh): unpacked once,
# here, by whichever script sources this first.
if [ -f "$here/bins.tar.xz" ]; then
    mkdir -p "$here/bin" && tar xJf "$here/bins.tar.xz" -C "$here/bin" && rm "$here/bins.tar.xz"
fi
out="${OUT:-$here/gpu-logs}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
ncu="$(command -v ncu || echo /usr/local/cuda/bin/ncu)"
# FlashAttention-4, where ../shared/peers/fa4/install.sh put it on this
# machine: peers.py then times its `fa4` rows.
if [ -d /tmp/fa4/site ]; then
    export PYTHONPATH="/tmp/fa4/site:/tmp/fa4/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
fi
# NCCL for the multi-GPU tests: cudarc loads it only as libnccl.so (or
# .so.<CUDA major>), but PyTorch's wheel ships libnccl.so.2 alone. Link the
# wheel's under cudarc's name (and its soname, for flashgen-candle's binaries,
# which link it) in a directory of the pack, first on the loader's path;
# nothing where python3 has no such wheel.
nccl_lib="$(python3 - 2>/dev/null <<'PY' || true
import os, site
try:
    import nvidia.nccl
    dirs = [os.path.join(p, "lib") for p in nvidia.nccl.__path__]
except ImportError:
    dirs = [os.path.join(p, "nvidia", "nccl", "lib") for p in site.getsitepackages()]
found = [os.path.join(d, "libnccl.so.2") for d in dirs if os.path.isfile(os.path.join(d, "libnccl.so.2"))]
print(found[0] if found else "")
PY
)"
if [ -n "$nccl_lib" ]; then
    mkdir -p "$here/nccl-lib"
    ln -sf "$nccl_lib" "$here/nccl-lib/libnccl.so"
    ln -sf "$nccl_lib" "$here/nccl-lib/libnccl.so.2"
    export LD_LIBRARY_PATH="$here/nccl-lib:$LD_LIBRARY_PATH"
fi
export NCCL_NVLS_ENABLE=0
