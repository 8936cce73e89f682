"""Where a kernel's warps wait, per SASS instruction, from an Nsight Compute source page saved as CSV.

    ncu --clock-control none -k regex:sage_sm90_d --launch-skip 1 -c 1 --section SourceCounters \\
        --section WarpStateStats --page source --print-source sass --csv \\
        python3 benchmarks/profile_sage_sm90.py --shape wan_14b_480p --k-block 128 --skip 1e30 > skipall.csv
    python3 benchmarks/ncu_hotspots.py skipall.csv --top 40 > skipall_hotspots.txt

Prints the stall reasons summed over the kernel, then the instructions with the most warp-stall samples (index
in the listing, samples, share, executions, the instruction, its three largest reasons). The CSV itself is some
2 MB per kernel; the summary is what the results keep.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import dataclass


@dataclass
class Instruction:
    index: int
    sass: str
    samples: int
    executed: int
    stalls: dict[str, int]


def read_source_page(path: str) -> list[Instruction]:
    """The per-instruction rows of an ``ncu --page source --csv`` listing (the lines before its header skipped)."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise SystemExit(f"{path}: no source-page header (\"Address\",...): was ncu run with --page source --csv?")
    reader = csv.reader(lines[start:])
    header = next(reader)
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    out = []
    for row in reader:
        if len(row) != len(header):
            continue
        cells = dict(zip(header, row))
        samples = cells["Warp Stall Sampling (All Samples)"]
        if not samples.isdigit():
            continue
        stalls = {c.removeprefix("stall_"): int(cells[c]) for c in reasons if cells[c].isdigit() and int(cells[c])}
        out.append(Instruction(len(out), cells["Source"].strip(), int(samples),
                               int(cells["Instructions Executed"] or 0), stalls))
    return out


def report(instructions: list[Instruction], top: int) -> str:
    total = sum(i.samples for i in instructions)
    by_reason: dict[str, int] = {}
    for ins in instructions:
        for reason, n in ins.stalls.items():
            by_reason[reason] = by_reason.get(reason, 0) + n
    lines = [f"{total} warp-stall samples over {len(instructions)} instructions",
             "by reason: " + ", ".join(f"{r} {n / total:.1%}" for r, n in sorted(by_reason.items(), key=lambda x: -x[1])[:10]),
             "", f"{'index':>5} {'samples':>8} {'share':>6} {'executed':>10}  instruction  (largest reasons)"]
    for ins in sorted(instructions, key=lambda i: -i.samples)[:top]:
        reasons = ", ".join(f"{r} {n}" for r, n in sorted(ins.stalls.items(), key=lambda x: -x[1])[:3])
        lines.append(f"{ins.index:5d} {ins.samples:8d} {ins.samples / total:6.1%} {ins.executed:10d}  {ins.sass[:64]}  ({reasons})")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=40, help="instructions to list")
    args = p.parse_args()
    print(report(read_source_page(args.csv), args.top), end="")


if __name__ == "__main__":
    main()
