"""Skip-softmax under ring attention, simulated on one process: KV split into shards.

Under Diffusers' ring attention each rank runs attention of its queries against one KV
shard at a time and the partial outputs merge by their log-sum-exp. Our rule (docs/design.md,
"Context parallelism"): every shard runs the skip rule on its own keys, its running max
starting afresh at the shard's first KV tile (never skipped), with the one-process ``lambda``.
This module runs exactly that with the reference route (per shard, with LSE, merged as
Diffusers merges) so the effect on skipped tiles and error can be measured without processes::

    python -m diffusers_trtllm.bench.ring_skip --tokens 8192 --thresholds 0.02,0.05,0.1
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from ..kernels.reference import reference_attention
from ..measure import rel_l1
from .cli import floats
from .inputs import Shape, structured_qkv

__all__ = ["RingResult", "merge_by_lse", "ring_reference", "measure"]


@dataclass
class RingResult:
    out: torch.Tensor
    lse: torch.Tensor
    skipped_tiles: int
    total_tiles: int

    @property
    def skipped_fraction(self) -> float:
        return self.skipped_tiles / self.total_tiles if self.total_tiles else 0.0


def merge_by_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial ``(out [..., H, D], lse [..., H])`` merged in order, with ``TemplatedRingAttention``'s formula."""
    out = lse = None
    for o, l in parts:
        o, l = o.float(), l.float()[..., None]
        if out is None:
            out, lse = o, l
            continue
        out = out - torch.sigmoid(l - lse) * (out - o)
        lse = lse - torch.nn.functional.logsigmoid(lse - l)
    return out, lse[..., 0]


def ring_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shards: int, *, softmax_scale: float,
                   threshold: float | None = None, first: int = 0, **tiles: int) -> RingResult:
    """One sequence's ``[tokens, heads, dim]`` attention over ``shards`` equal KV shards, merged by LSE.

    ``threshold``: the one-process ``lambda`` (each shard passes ``threshold * shard_len`` as its
    factor, so ``lambda = threshold`` on every shard). ``first``: the shard visited first (a ring
    rank starts with its own), which only changes float order.
    """
    lq, lkv = q.shape[0], k.shape[0]
    if lkv % shards:
        raise ValueError(f"{lkv} keys do not split into {shards} equal shards.")
    shard = lkv // shards
    cu_q = torch.tensor([0, lq], dtype=torch.int32, device=q.device)
    cu_kv = torch.tensor([0, shard], dtype=torch.int32, device=q.device)
    parts, skipped, total = [], 0, 0
    for i in range(shards):
        part = slice(((first + i) % shards) * shard, ((first + i) % shards + 1) * shard)
        res = reference_attention(q, k[part], v[part], cu_q, cu_kv, (lq,), (shard,), softmax_scale=softmax_scale,
                                  skip_factor=None if threshold is None else threshold * shard, **tiles)
        parts.append((res.out, res.lse))
        skipped, total = skipped + res.skipped_tiles, total + res.total_tiles
    out, lse = merge_by_lse(parts)
    return RingResult(out, lse, skipped, total)


def measure(shape: Shape, thresholds: tuple[float, ...], degrees: tuple[int, ...], locality: float = 0.5,
            seed: int = 0, tile: int = 128) -> list[dict]:
    """Skipped fraction and rel-L1 against dense of each ring degree (1: one process) and threshold."""
    q, k, v = (x[0] for x in structured_qkv(shape, locality, seed=seed, dtype=torch.float32))
    scale = shape.head_dim ** -0.5
    dense = ring_reference(q, k, v, 1, softmax_scale=scale).out
    rows = []
    for threshold in thresholds:
        for degree in degrees:
            res = ring_reference(q, k, v, degree, softmax_scale=scale, threshold=threshold, tile_q=tile, tile_kv=tile)
            rows.append({"threshold": threshold, "ring_degree": degree, "skipped_fraction": res.skipped_fraction,
                         "rel_l1_vs_dense": rel_l1(res.out, dense)})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m diffusers_trtllm.bench.ring_skip", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--grid", default="8,32,32", help="token grid of the structured inputs (video: frames,h,w)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--locality", type=float, default=0.5)
    p.add_argument("--thresholds", type=floats, default=(0.02, 0.05, 0.1))
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--tile", type=int, default=128, help="square tile of the skip rule")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    grid = tuple(int(x) for x in args.grid.split(",") if x.strip())
    shape = Shape("ring_skip", 1, args.tokens, args.heads, args.head_dim, grid)
    rows = measure(shape, args.thresholds, tuple(int(x) for x in args.degrees.split(",")), args.locality, args.seed,
                   args.tile)
    print(f"| threshold | ring degree | skipped tiles | rel-L1 vs dense |   ({args.tokens} tokens, grid {grid}, "
          f"{args.heads} heads, dim {args.head_dim}, locality {args.locality}, {args.tile}x{args.tile} tiles)")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['threshold']:g} | {r['ring_degree']} | {r['skipped_fraction']:.3f} | {r['rel_l1_vs_dense']:.4f} |")
    return rows


if __name__ == "__main__":
    main()
