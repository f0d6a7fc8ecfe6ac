# Sourced by the scripts that build flashgen-candle: candle-core's `cuda`
# feature compiles candle's kernels with nvcc in its build script and links
# the CUDA libraries (cudarc's dynamic-linking). Uses an installed CUDA
# toolkit when nvcc is on PATH; else installs NVIDIA's CUDA 13.0 compiler,
# headers and CCCL from PyPI into target/pypi-cuda once, with link stubs (as
# a toolkit's lib64/stubs) for the libraries a machine without a GPU lacks.
# The stubs only satisfy the linker: binaries load the real libraries at run
# time (libcuda from the driver; libcudart, libcublas, libcublasLt,
# libcurand and libnvrtc from a CUDA 13 toolkit or NVIDIA's wheels).
flashgen_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
if ! command -v nvcc >/dev/null 2>&1; then
    flashgen_cuda="$flashgen_root/target/pypi-cuda"
    export CUDA_ROOT="$flashgen_cuda/nvidia/cu13"
    if [ ! -x "$CUDA_ROOT/bin/nvcc" ]; then
        echo "flashgen: no nvcc found; installing CUDA 13.0's compiler from PyPI into target/pypi-cuda" >&2
        python3 -m pip install --quiet --disable-pip-version-check --target "$flashgen_cuda" \
            'nvidia-cuda-nvcc==13.0.*' 'nvidia-nvvm==13.0.*' 'nvidia-cuda-crt==13.0.*' \
            'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-cccl==13.0.*'
    fi
    if [ ! -e "$CUDA_ROOT/lib/stubs/libnccl.so" ]; then
        python3 "$flashgen_root/scripts/cuda-link-stubs.py" "$flashgen_root/candle" "$CUDA_ROOT/lib/stubs"
        # candle's kernels link the CUDA runtime; the wheel ships it without
        # the unversioned name the linker looks for.
        ln -sf ../libcudart.so.13 "$CUDA_ROOT/lib/stubs/libcudart.so"
    fi
    export PATH="$CUDA_ROOT/bin:$PATH"
fi
