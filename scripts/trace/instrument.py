#!/usr/bin/env python3
"""Puts clock64() trace points into a generated warp-specialized forward
kernel (`flashgen emit --arch sm_90 --config wgmma.wN...`) for
scripts/trace/harness.cu.

    instrument.py KERNEL.cu [NAME=VALUE ...] > traced.cu

Each event is anchored on a line of the generated source; a required anchor
that is missing stops the script with its text, so a codegen change that
moves one shows up here rather than as a silent hole in the trace. Thread 0
of each warpgroup (the consumers' and the producer's) of the first
TRACE_CTAS CTAs appends (event << 56 | clock64) to its row of g_trace.
Compiled with -DTRACE_ON=0 the points vanish: the same kernel, untimed.

The NAME=VALUE pairs give the kernel's runtime params (e.g. window=1024);
the script also writes the launch's spec arguments (EXTRA_ARGS, between
`scale` and `work_counter`) for the harness. Captured tensors are not
supported: the harness has no data for them.
"""
import re
import sys

# (code, name, anchor regex, after the anchor?, required?). Consumer events
# are 1..19, producer events 20.. (analyze.py tells the roles apart by them).
EVENTS = [
    (1, "item", r"^ {8}mbar_wait\(item_full \+ 8 \* qb, done / 2 % 2\);.*\n", True, True),
    (2, "qfull", r"^ {8}mbar_wait\(q_full \+ 8 \* qb, done / 2 % 2\);.*\n", True, True),
    (3, "kfull", r"^ {12}mbar_wait\(k_full \+ 8 \* stage, it / STAGES % 2\);\n(?= {12}const int tile = )", True, True),
    (4, "turn", r"^ {12}named_barrier_sync\(1 \+ warpgroup, 256\);  // this warpgroup's turn.*\n", True, False),
    (5, "sdone", r"^ {12}fence_operands\(s\[0\]\);\n", True, True),
    (6, "smax", r"^ {12}wgmma_wait<0>\(\);  // P V is done.*\n", False, True),
    (7, "pvdone", r"^ {12}wgmma_wait<0>\(\);  // P V is done.*\n", True, True),
    (12, "tileend", r"^ {12}pv_pending = true;\n", True, True),
    (8, "pass", r"^ {8}    mbar_arrive\(v_empty \+ 8 \* stage\);\n {8}\}\n", True, False),
    (9, "loopexit", r"^ {8}// The last visited tile's P V\.\n", False, True),
    (10, "lastpv", r"^ {12}if \(lane == 0\) mbar_arrive\(v_empty \+ 8 \* v_stage\);  // done with its V\n {8}\}\n", True, True),
    (13, "epi_start", r"^ {8}(named_barrier_sync\(3 \+ WARPGROUPS \+ warpgroup, 128\);|__syncwarp\(\);  // the copy engine has read).*\n", True, False),
    (14, "o_staged", r"^ {8}// The copy engine stores the warp's rows\.\n", False, False),
    (15, "o_stored", r"^ {12}(tma_store_wait_read\(\);|tma_store_tile<.*;)\n {8}\}\n", True, False),
    (11, "epi", r"^ {8}if \(lane == 0\) mbar_arrive\(q_empty \+ 8 \* qb\);.*\n", True, True),
    (20, "p_qempty", r"^ {12}mbar_wait\(q_empty \+ 8 \* qb, \(done / 2 \+ 1\) % 2\);\n", True, True),
    (21, "p_claim", r"^ {12}if \(item >= items\) break;  // the consumers stop.*\n", False, True),
    (25, "p_first", r"^ {12}int j = next_tile\(0\);\n", True, True),
    (22, "p_tile", r"^ {16}mbar_wait\(k_empty \+ 8 \* stage, empty_parity\);\n", False, True),
    (23, "p_kempty", r"^ {16}mbar_wait\(k_empty \+ 8 \* stage, empty_parity\);\n", True, True),
    (24, "p_vempty", r"^ {16}mbar_wait\(v_empty \+ 8 \* stage, empty_parity\);\n", True, True),
]

PRELUDE = r"""
// ---- trace points (scripts/trace/instrument.py) ----
#ifndef TRACE_ON
#define TRACE_ON 1
#endif
#define TRACE_CTAS 8
#define TRACE_N 8192
__device__ unsigned long long g_trace[TRACE_CTAS][5][TRACE_N];
__device__ int g_trace_n[TRACE_CTAS][5];
#if TRACE_ON
// The count lives in a register (trace_n_, declared at the kernel's top) and
// is only stored: a load of it from global memory would put an L2 round trip
// into every traced span.
#define TR(code) do { if (blockIdx.x < TRACE_CTAS && threadIdx.x % 128 == 0) { \
    const int role_ = threadIdx.x / 128, n_ = trace_n_++; \
    if (n_ < TRACE_N) g_trace[blockIdx.x][role_][n_] = (unsigned long long)(code) << 56 | ((unsigned long long)clock64() & ((1ull << 56) - 1)); \
    g_trace_n[blockIdx.x][role_] = trace_n_; } } while (0)
#define TRACE_COUNTER int trace_n_ = 0;
#else
#define TR(code) do {} while (0)
#define TRACE_COUNTER
#endif
"""

# The kernel's leading arguments, which the harness passes itself.
LEADING = ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse", "batch", "heads", "heads_kv", "q_len", "kv_len"]


def fail(message):
    sys.exit(f"instrument.py: {message}")


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
        fail("usage: instrument.py KERNEL.cu [NAME=VALUE ...]")
    src = open(sys.argv[1]).read()
    params = dict(p.split("=", 1) for p in sys.argv[2:])
    name, args = spec_args(src, params)
    for code, event, anchor, after, required in EVENTS:
        pattern = re.compile(anchor, re.M)
        if not pattern.search(src):
            if required:
                fail(f"event {event}: anchor not found: {anchor}")
            continue
        point = lambda m: (m.group(0) + f"TR({code});\n" if after else f"TR({code});\n" + m.group(0))
        src = pattern.sub(point, src)
    body = re.search(r'extern "C" __global__ void __launch_bounds__\([^)]*\) \w+\(.*?\) \{\n', src, re.S)
    src = src[: body.end()] + "    TRACE_COUNTER\n" + src[body.end() :]
    head = src.index('extern "C" __global__')
    extra = "".join(f"{a}, " for a in args)
    launch = f"#define KERNEL {name}\n#define EXTRA_ARGS {extra}\n"
    sys.stdout.write(src[:head] + PRELUDE + launch + src[head:])


if __name__ == "__main__":
    main()
