#!/usr/bin/env python3
"""Compiles a generated kernel (CUDA source, e.g. from `flashgen emit`) with
NVRTC to a CUBIN and prints ptxas's register/spill report, and with --sass
the SASS and an opcode histogram of the innermost loop, without a GPU; with
--roles, instead of the SASS, a warp-specialized kernel's spill instructions
per role (ptxas reports them for the whole kernel).

    flashgen emit specs/causal.attn > /tmp/k.cu
    scripts/sass.py /tmp/k.cu [--arch sm_90a] [--sass | --roles]

Needs libnvrtc (scripts/nvrtc-env.sh installs it from PyPI) and, for
--sass, cuobjdump (`pip download nvidia-cuda-cuobjdump`, unzip; set
CUOBJDUMP or put it on PATH)."""
import argparse, collections, ctypes, os, re, shutil, subprocess, sys, tempfile


def nvrtc():
    names = [os.environ.get("NVRTC_LIB"), "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    sys.exit("libnvrtc not found: source scripts/nvrtc-env.sh first")


def compile_cubin(lib, src, arch):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(log.value.decode())
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    return log.value.decode(), cubin.raw


def main():
    p = argparse.ArgumentParser()
    p.add_argument("source")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--sass", action="store_true")
    p.add_argument("--roles", action="store_true", help="spill instructions per warp role (needs cuobjdump)")
    a = p.parse_args()
    log, cubin = compile_cubin(nvrtc(), open(a.source).read(), a.arch)
    keep = ("registers", "spill", "smem", "arning", "serialized")
    print("\n".join(l for l in log.splitlines() if any(k in l for k in keep)))
    if not (a.sass or a.roles):
        return
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or sys.exit("cuobjdump not found")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        run = subprocess.run([tool, "-sass", path], capture_output=True, text=True)
        if run.returncode:
            sys.exit(run.stderr)
        sass = run.stdout
    if a.roles:
        return print(spills_per_role(sass))
    print(sass)
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    print("opcode histogram (whole kernel):", ", ".join(f"{k} {v}" for k, v in ops.most_common(30)))


def spills_per_role(sass):
    """Local-memory stores and loads (STL, LDL) by where they sit: before the
    roles part ("setup"), after the consumers' `setmaxnreg` increase or after
    the producer's decrease, up to the next of these."""
    role, counts = "setup", collections.Counter()
    for line in sass.splitlines():
        if "USETMAXREG.TRY_ALLOC" in line:
            role = "consumers"
        elif "USETMAXREG.DEALLOC" in line:
            role = "producer"
        m = re.search(r"\b(STL|LDL)\b", line)
        if m:
            counts[(role, m.group(1))] += 1
    return "spill instructions: " + (", ".join(f"{r} {op} {n}" for (r, op), n in sorted(counts.items())) or "none")


main()
