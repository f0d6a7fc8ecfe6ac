#!/usr/bin/env python3
"""What scripts/trace/harness.cu needs of a traced forward kernel
(`flashgen emit --trace --arch sm_90 --config wgmma.wN...`) besides the
kernel: its name and the launch's spec arguments.

    harness_args.py KERNEL.cu [NAME=VALUE ...] >> KERNEL.cu

prints `#define KERNEL <name>`, `#define EXTRA_ARGS ...` (the arguments
between `scale` and `work_counter`, read off the kernel's signature) and
`#define COLUMN_TILES ...` (the global columns' tiles of its Q buffers, in
elements, 0 without them: the harness's shared memory). The
NAME=VALUE pairs give the kernel's runtime params (e.g. window=1024).
Captured tensors are not supported: the harness has no data for them.

EVENTS names the trace points' codes for analyze.py; codegen prints them
(codegen/src/cuda/forward/trace.rs, whose `Event` this table mirrors).
"""
import re
import sys

# (code, name). Consumer events are 1..19, producer events 20.. (analyze.py
# tells the roles apart by them).
EVENTS = [
    (1, "item"),
    (2, "qfull"),
    (16, "columns"),
    (3, "kfull"),
    (4, "turn"),
    (5, "sdone"),
    (6, "smax"),
    (7, "pvdone"),
    (12, "tileend"),
    (8, "pass"),
    (9, "loopexit"),
    (10, "lastpv"),
    (13, "epi_start"),
    (14, "o_staged"),
    (15, "o_stored"),
    (11, "epi"),
    (20, "p_qempty"),
    (21, "p_claim"),
    (25, "p_first"),
    (22, "p_tile"),
    (23, "p_kempty"),
    (24, "p_vempty"),
]

# The kernel's leading arguments, which the harness passes itself.
LEADING = ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse", "batch", "heads", "heads_kv", "q_len", "kv_len"]


def fail(message):
    sys.exit(f"harness_args.py: {message}")


def spec_args(src, params):
    """The C arguments between `scale` and `work_counter`, from `params`."""
    sig = re.search(r'extern "C" __global__ void __launch_bounds__\([^)]*\) (\w+)\((.*?)\) \{', src, re.S)
    if not sig:
        fail("no kernel signature found")
    names = [re.findall(r"(\w+)$", a.strip())[0] for a in sig.group(2).split(",")]
    if names[: len(LEADING)] != LEADING or "scale" not in names or "work_counter" not in names:
        fail(f"unexpected kernel arguments: {', '.join(names)}")
    args = []
    for decl in sig.group(2).split(",")[names.index("scale") + 1 : names.index("work_counter")]:
        name = re.findall(r"(\w+)$", decl.strip())[0]
        if name == "block_mask":
            args.append("nullptr")
        elif name.startswith("block_mask_"):
            args.append("0")
        elif name.startswith("p_") and name[2:] in params:
            args.append(params[name[2:]])
        elif name.startswith("p_"):
            fail(f"the kernel takes param `{name[2:]}`: pass {name[2:]}=VALUE")
        else:
            fail(f"the kernel reads `{decl.strip()}`, which the harness cannot supply")
    return sig.group(1), args


def main():
    if len(sys.argv) < 2:
        fail("usage: harness_args.py KERNEL.cu [NAME=VALUE ...]")
    src = open(sys.argv[1]).read()
    if "TRACE_COUNTER" not in src:
        fail("not a traced kernel: emit it with `flashgen emit --trace`")
    params = dict(p.split("=", 1) for p in sys.argv[2:])
    name, args = spec_args(src, params)
    extra = "".join(f"{a}, " for a in args)
    columns = "2 * COLUMN_TILE" if "constexpr int COLUMN_TILE " in src else "0"
    sys.stdout.write(f"#define KERNEL {name}\n#define EXTRA_ARGS {extra}\n#define COLUMN_TILES {columns}\n")


if __name__ == "__main__":
    main()
