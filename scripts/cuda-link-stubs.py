"""Writes link-time stubs of the CUDA libraries cudarc links (what a CUDA
toolkit's lib64/stubs holds), for building on a machine without them.

    python3 cuda-link-stubs.py MANIFEST_DIR OUT_DIR

Each stub exports every function cudarc's bindings of that library name,
under the real library's soname, so the binary records the real library
and loads it at run time. Loaded in its place (the soname links beside it
let tests that never touch CUDA start on a machine without it), a stub
function aborts with its name. The function names come from the cudarc
sources cargo resolved for MANIFEST_DIR's crate.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

# cudarc module -> (library name the linker is given, soname of CUDA 13's).
LIBRARIES = {
    "driver": ("cuda", "libcuda.so.1"),
    "nvrtc": ("nvrtc", "libnvrtc.so.13"),
    "cublas": ("cublas", "libcublas.so.13"),
    "cublaslt": ("cublasLt", "libcublasLt.so.13"),
    "curand": ("curand", "libcurand.so.10"),
    # flashgen-candle's `nccl` feature.
    "nccl": ("nccl", "libnccl.so.2"),
}


def cudarc_dir(manifest_dir):
    meta = subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--manifest-path", os.path.join(manifest_dir, "Cargo.toml")],
        check=True, capture_output=True, text=True,
    )
    packages = json.loads(meta.stdout)["packages"]
    return os.path.dirname(next(p["manifest_path"] for p in packages if p["name"] == "cudarc"))


def main(manifest_dir, out_dir):
    src = os.path.join(cudarc_dir(manifest_dir), "src")
    os.makedirs(out_dir, exist_ok=True)
    for module, (name, soname) in LIBRARIES.items():
        with open(os.path.join(src, module, "sys", "mod.rs")) as f:
            symbols = sorted(set(re.findall(r'load::<_F>\("(\w+)"\)', f.read())))
        if not symbols:
            sys.exit(f"cuda-link-stubs: no functions found in cudarc's {module} bindings")
        with tempfile.NamedTemporaryFile("w", suffix=".c", delete=False) as c:
            c.write("#include <stdio.h>\n#include <stdlib.h>\n")
            c.write(f'static void stub(const char *f) {{ fprintf(stderr, "{soname} stub: %s called; the real library is not installed\\n", f); abort(); }}\n')
            c.write("".join(f'void {s}(void) {{ stub("{s}"); }}\n' for s in symbols))
        out = os.path.join(out_dir, f"lib{name}.so")
        subprocess.run(["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", out, c.name], check=True)
        os.unlink(c.name)
        link = os.path.join(out_dir, soname)
        if not os.path.lexists(link):
            os.symlink(f"lib{name}.so", link)


if __name__ == "__main__":
    main(*sys.argv[1:3])
