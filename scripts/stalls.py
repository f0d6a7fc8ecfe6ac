#!/usr/bin/env python3
"""Where a kernel's warps wait: the SASS page of an Nsight Compute report
(`ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv`,
as scripts/gpu-stalls.sh writes it) summarized per instruction.

How: python3 stalls.py sass.csv [--top 30] [--per N]

Prints the total warp-stall samples, then the instructions with the most
samples: their share, how often they ran, the SASS and their two largest
stall reasons. With --per N every count is also divided by N (the kernel's
visited steps, say), so two kernels can be compared per unit of work.
With --roles, first the samples of a warp-specialized kernel by role (the
code from its consumers' `setmaxnreg` increase to its producer's decrease,
and from there on) and, within each role, by how often the code ran (once
per tile, once per item...): where the consumers' time goes between tiles.
Needs only the standard library.
"""
import csv
import sys


def main(argv):
    if not argv or argv[0].startswith("-"):
        print(__doc__.strip())
        return 2
    path, options = argv[0], {"--top": 30.0, "--per": None}
    rest = argv[1:]
    roles = "--roles" in rest
    rest = [a for a in rest if a != "--roles"]
    while rest:
        if rest[0] not in options or len(rest) < 2:
            print(f"stalls.py: expected --top N, --per N or --roles, got {' '.join(rest)}", file=sys.stderr)
            return 2
        options[rest[0]], rest = float(rest[1]), rest[2:]
    top, per = int(options["--top"]), options["--per"]
    rows = list(csv.reader(open(path, encoding="utf-8", errors="replace")))
    # The first row names the kernel; the second is the header.
    header, data = rows[1], rows[2:]
    samples = header.index("Warp Stall Sampling (All Samples)")
    executed = header.index("Instructions Executed")
    reasons = [i for i, h in enumerate(header) if h.startswith("stall_") and "(Not Issued)" not in h]
    number = lambda s: float(s) if s.replace(".", "", 1).isdigit() else 0.0
    total = sum(number(r[samples]) for r in data)
    scale = f" ({total / per:.3f} per unit)" if per else ""
    print(f"{path}: {len(data)} instructions, {total:.0f} samples{scale}")
    if roles:
        print_roles(data, samples, executed, reasons, header, number, total)
    ranked = sorted(range(len(data)), key=lambda i: -number(data[i][samples]))[:top]
    for i in ranked:
        r = data[i]
        s = number(r[samples])
        why = sorted(((number(r[j]), header[j][len("stall_"):]) for j in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {count:.0f}" for count, name in why if count > 0)
        unit = f" {s / per:7.3f}/unit" if per else ""
        print(f"{i:5d} {s:8.0f} {100 * s / max(total, 1):5.1f}%{unit} x{r[executed]:>10} {r[1].strip()[:64]:64} {why}")
    return 0


def print_roles(data, samples, executed, reasons, header, number, total):
    """Samples per role, then per execution count within each role."""
    marks = {kind: i for i, r in enumerate(data) for kind in ("TRY_ALLOC", "DEALLOC") if "USETMAXREG." + kind in r[1]}
    if len(marks) < 2:
        print("  (no setmaxnreg pair: not a warp-specialized kernel)")
        return
    bounds = sorted((i, "consumers" if kind == "TRY_ALLOC" else "producer") for kind, i in marks.items())
    spans = [(0, bounds[0][0], "prologue"), (bounds[0][0], bounds[1][0], bounds[0][1]), (bounds[1][0], len(data), bounds[1][1])]
    for lo, hi, role in spans:
        rows = data[lo:hi]
        role_total = sum(number(r[samples]) for r in rows)
        print(f"  {role}: {role_total:.0f} samples ({100 * role_total / max(total, 1):.1f}%)")
        by_count = {}
        for r in rows:
            count = by_count.setdefault(r[executed], [0.0, 0, {}])
            count[0] += number(r[samples])
            count[1] += 1
            for j in reasons:
                count[2][header[j][len("stall_"):]] = count[2].get(header[j][len("stall_"):], 0.0) + number(r[j])
        for executions, (s, n, why) in sorted(by_count.items(), key=lambda kv: -kv[1][0])[:6]:
            top = sorted(why.items(), key=lambda kv: -kv[1])[:3]
            top = ", ".join(f"{name} {100 * c / max(s, 1):.0f}%" for name, c in top if c > 0)
            print(f"    x{executions:>10} {s:8.0f} {100 * s / max(role_total, 1):5.1f}% of the role, {n:4d} instructions: {top}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
