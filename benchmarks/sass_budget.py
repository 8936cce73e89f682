"""The ``sage-sm90`` kernel's main loop in SASS, path by path: how many instructions a consumer thread issues a KV
tile, and of which kinds (issue 57: where a short call's GPU time goes). Needs no GPU: a compiler (nvcc or NVRTC)
and ``cuobjdump`` (Triton ships one).

    python3 benchmarks/sass_budget.py [--builds default,slack2=SAGE_SM90_RESCALE_SLACK=2] [--skip] [--k-block 128]

A consumer warp's instructions over a tile, times the two consumer warps each scheduler holds, bound the tile's
time from below by issue (one instruction a cycle a scheduler), beside the tensor cores' 1,024 cycles a tile at
their peak (Q.K^T and P.V of 128 x 128 x 128, int8 and fp8, 4,096 multiply-adds a cycle an SM on an H100).

The loop is the smallest backward branch whose body issues both products. Its paths run from its head to that
branch; a branch out of the body (a barrier's retry, out of line) or back inside it (a spin) counts as not taken.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import sass_hazards  # noqa: E402

from diffusers_trtllm.kernels import sage_sm90  # noqa: E402

#: Opcode families shown as columns (the rest count in "other").
_COLUMNS = ("MUFU", "FFMA", "FMUL", "FADD", "IADD3", "F2FP", "HALF", "MINMAX", "UNIFORM", "GMMA", "SYNC")


def _family(instruction: str) -> str:
    """The column an instruction counts in."""
    op = instruction.split()[0] if not instruction.startswith("@") else instruction.split()[1]
    base = op.split(".")[0]
    if base in ("MUFU", "FFMA", "FMUL", "FADD", "IADD3", "F2FP"):
        return base
    if base in ("HADD2", "HFMA2", "HMUL2", "HMNMX2"):
        return "HALF"
    if base in ("VIMNMX", "VIMNMX3", "FMNMX", "IMNMX"):
        return "MINMAX"
    if base.startswith("U") or base == "R2UR":
        return "UNIFORM"
    if base.endswith("GMMA") or base == "WARPGROUP":
        return "GMMA"
    if base in ("SYNCS", "BAR", "VOTE", "SHFL", "WARPSYNC"):
        return "SYNC"
    return "other"


def main_loop(code: list[tuple[int, str]], index: dict[int, int]) -> tuple[int, int]:
    """Indices of the main loop's head and of its backward branch (the innermost loop issuing both products: the
    kernel's outer loops and the barriers' out-of-line retries hold it); ``index``: each address's position."""
    best = None
    for i, (address, instruction) in enumerate(code):
        m = sass_hazards._BRANCH.match(instruction)
        if m is None or int(m.group(2), 16) >= address:
            continue
        head = index[int(m.group(2), 16)]
        body = " ".join(text for _, text in code[head:i])
        if "IGMMA" in body and "QGMMA" in body and (best is None or i - head < best[1] - best[0]):
            best = (head, i)
    if best is None:
        raise SystemExit("no loop issuing both products found")
    return best


def loop_paths(code: list[tuple[int, str]], index: dict[int, int], head: int, end: int) -> list[list[int]]:
    """Every path (instruction indices) from the loop's head to its backward branch."""
    paths, stack = [], [(head, [])]
    while stack:
        i, path = stack.pop()
        while True:
            path = path + [i]
            if i == end:
                paths.append(path)
                break
            m = sass_hazards._BRANCH.match(code[i][1])
            target = index.get(int(m.group(2), 16)) if m else None
            inside = target is not None and i < target <= end
            if m and inside and m.group(1) is None:  # unconditional jump forward
                i = target
                continue
            if m and inside:  # conditional forward branch: both ways
                stack.append((target, path))
            i += 1
    return paths


def budget(code: list[tuple[int, str]]) -> list[Counter]:
    """Each path of the main loop's instructions by family (``_COLUMNS``, "other") and in all ("total"), shortest
    first."""
    index = {address: i for i, (address, _) in enumerate(code)}
    rows = []
    for path in loop_paths(code, index, *main_loop(code, index)):
        families = Counter(_family(code[i][1]) for i in path)
        families["total"] = len(path)
        rows.append(families)
    return sorted(rows, key=lambda c: c["total"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", default="default", help="name=DEFINE[+DEFINE...], comma-separated ('default': none)")
    p.add_argument("--k-block", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--skip", action="store_true", help="the skip-softmax entry point")
    args = p.parse_args()
    cuobjdump = sass_hazards.find_cuobjdump()
    if cuobjdump is None:
        raise SystemExit("no cuobjdump: install triton or the CUDA toolkit")
    variant = sage_sm90.Variant(args.head_dim, torch.bfloat16, args.k_block, args.skip)
    print(f"{variant.name}: the main loop's paths, instructions a consumer thread a KV tile "
          f"(2 consumer warps a scheduler: twice that in issue cycles a tile, against 1,024 tensor-core cycles)\n")
    print("| build | " + " | ".join(("total", *_COLUMNS, "other")) + " |")
    print("|---|" + "---:|" * (len(_COLUMNS) + 2))
    for spec in args.builds.split(","):
        name, _, defines = spec.partition("=")
        cubin = sage_sm90.sage_sm90_cubin(variant, tuple(filter(None, defines.split("+"))))
        sass = sass_hazards.cubin_sass(cuobjdump, Path(cubin))
        for row in budget(sass[variant.name]):
            print(f"| {name} | " + " | ".join(str(row[c]) for c in ("total", *_COLUMNS, "other")) + " |")


if __name__ == "__main__":
    main()
