# Sourced by the set-up scripts: makes sure libnvrtc is installed. Uses a
# CUDA toolkit's NVRTC when one is installed, else installs NVIDIA's PyPI
# wheel (nvidia-cuda-nvrtc, CUDA 13) into target/pypi-nvrtc once. The
# runtime looks in both places itself (runtime/src/nvrtc_lib.rs), so plain
# cargo commands find it; LD_LIBRARY_PATH is set for other tools' sake.
flashgen_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
flashgen_pypi="$flashgen_root/target/pypi-nvrtc"
flashgen_pypi_lib="$flashgen_pypi/nvidia/cu13/lib"
if ! { ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; } \
    && ! ls /usr/local/cuda/lib64/libnvrtc.so* >/dev/null 2>&1 \
    && [ ! -e "$flashgen_pypi_lib/libnvrtc.so.13" ]; then
    echo "flashgen: no NVRTC found; installing nvidia-cuda-nvrtc from PyPI into target/pypi-nvrtc" >&2
    python3 -m pip install --quiet --disable-pip-version-check --target "$flashgen_pypi" 'nvidia-cuda-nvrtc>=13,<14'
fi
[ -d /usr/local/cuda/lib64 ] && export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
[ -d "$flashgen_pypi_lib" ] && export LD_LIBRARY_PATH="$flashgen_pypi_lib:${LD_LIBRARY_PATH:-}"
true
