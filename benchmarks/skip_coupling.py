"""How much of skip-softmax's saving a ``sage-sm90`` CTA can take: its two consumer warpgroups (64 query rows
each) vote on their own tiles, but they share K/V stages, so neither runs more than a few tiles ahead.

From the reference's tile rule (``tile_criticals``, on a few heads of the bench's structured inputs), per target
fraction of 64 x 128 tiles skipped: the fraction both warpgroups of a CTA skip, and a CTA's modelled time against
its time with nothing skipped, a kept tile costing 1 and a skipped one ``cost`` (0.53 measured on the H200 with
every tile skipped, docs/performance.md), when a warpgroup may lead the other by 1 tile (the ping-pong), 3 (the
stages), or without bound, beside the ideal (every tile at its own cost). ``--row-group G`` deals a 128-row
block's rows to the two warpgroups in turns of G (64: the kernel's halves), to see whether another split of the rows
evens their work. CPU only; wan_14b_480p takes ~40 s.

    python3 benchmarks/skip_coupling.py --shape wan_14b_480p --reach-spread 1
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from diffusers_trtllm.bench.inputs import parse_shapes, structured_qkv
from diffusers_trtllm.bench.suite import heads_subset
from diffusers_trtllm.measure import threshold_for, tile_criticals

#: How far each warpgroup may run ahead of the other: the ping-pong's turns (the first consumer ends tile n
#: after the second ended n - 1, the second after the first ended n), K/V stages shared (3 tiles), unbounded.
LEADS = {"ping-pong": (1, 0), "stages (lead 3)": (3, 3), "free": (10**9, 10**9)}


def cta_time(skip_a: np.ndarray, skip_b: np.ndarray, cost: float, lead_a: int, lead_b: int) -> float:
    """Mean time per tile of CTAs whose warpgroups skip ``skip_a`` / ``skip_b`` (``[..., tiles - 1]``, tile 0 is
    never skipped): a warpgroup ends tile n after its tile n - 1 plus the tile's cost, and not before the other
    ends tile n - lead."""
    ones = np.ones(skip_a.shape[:-1] + (1,))
    cost_a = np.concatenate([ones, np.where(skip_a, cost, 1.0)], -1)
    cost_b = np.concatenate([ones, np.where(skip_b, cost, 1.0)], -1)
    done_a, done_b = np.zeros_like(cost_a), np.zeros_like(cost_b)
    for n in range(cost_a.shape[-1]):
        before_a = done_a[..., n - 1] if n else 0.0
        before_b = done_b[..., n - 1] if n else 0.0
        done_a[..., n] = before_a + cost_a[..., n]
        if n - lead_a >= 0:
            done_a[..., n] = np.maximum(done_a[..., n], done_b[..., n - lead_a])
        done_b[..., n] = before_b + cost_b[..., n]
        if n - lead_b >= 0:
            done_b[..., n] = np.maximum(done_b[..., n], done_a[..., n - lead_b])
    return float(np.maximum(done_a[..., -1], done_b[..., -1]).mean() / cost_a.shape[-1])


def dealt_rows(tokens: int, group: int) -> torch.Tensor:
    """Query rows in the order that gives each warpgroup (64 rows in a row, 128 a CTA) the rows dealt to it in turns
    of ``group`` within each 128-row block; rows past the last whole block stay where they are."""
    turns = torch.arange(128).view(-1, group)
    block = torch.cat([turns[0::2].reshape(-1), turns[1::2].reshape(-1)])
    whole = tokens // 128
    dealt = (torch.arange(whole)[:, None] * 128 + block).reshape(-1)
    return torch.cat([dealt, torch.arange(whole * 128, tokens)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="wan_14b_480p")
    p.add_argument("--reach-spread", type=float, default=1.0)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--cost", type=float, default=0.53, help="a skipped tile's time over a kept one's")
    p.add_argument("--targets", default="0.2,0.3,0.4,0.5")
    p.add_argument("--row-group", type=int, default=64, choices=(8, 16, 32, 64),
                   help="rows dealt to each warpgroup in turns (64: contiguous halves, as the kernel)")
    args = p.parse_args()
    shape = parse_shapes(args.shape)[0]
    q, k, _ = (x[0] for x in structured_qkv(shape, 0.5, reach_spread=args.reach_spread))
    heads = heads_subset(shape.heads, args.heads)
    rows = dealt_rows(q.shape[0], args.row_group)
    crit = tile_criticals(q[rows][:, heads], k[:, heads], shape.head_dim**-0.5, 64, 128)
    pairs = crit.shape[1] // 2
    print(f"{shape.name}, reach spread {args.reach_spread}, {len(heads)} heads, rows dealt in turns of "
          f"{args.row_group}, a skipped tile "
          f"costing {args.cost} of a kept one; CTA time per tile over nothing skipped:")
    print("| skipped (64-row tiles) | both warpgroups skip | " + " | ".join(LEADS) + " | ideal |")
    print("|---:|---:|" + "---:|" * (len(LEADS) + 1))
    for target in (float(t) for t in args.targets.split(",")):
        skip = (crit < threshold_for(crit, target)).numpy()
        skip_a, skip_b = skip[:, 0 : 2 * pairs : 2], skip[:, 1 : 2 * pairs : 2]
        both = (skip_a & skip_b).sum() / skip_a.size * (crit.shape[2] / (crit.shape[2] + 1))
        times = [cta_time(skip_a, skip_b, args.cost, *lead) for lead in LEADS.values()]
        print(f"| {target:.2f} | {both:.3f} | " + " | ".join(f"{t:.3f}" for t in times)
              + f" | {1 - target * (1 - args.cost):.3f} |")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
