"""Which dense route is fastest on Hopper, from measurements (not guesses).

On SM90 three routes can run dense bf16/fp16 attention: ``fa3`` (FlashInfer's FA3),
``fmha-v2`` (TRT-LLM's FMHAv2) and ``sdpa`` (cuDNN). Their order depends on the
shape, so ``backend="auto"`` asks this table, keyed by head dim and a KV-length
bucket. Each entry comes from ``benchmarks/results/bench_h200.json`` (H200,
FlashInfer 0.7.4, torch 2.11); a shape outside the table keeps the default order.
"""

from __future__ import annotations

from ..routes import AttentionCall, device_sm

__all__ = ["SM90_DENSE_ORDER", "TEXT_KV", "LONG_KV", "kv_bucket", "dense_priority", "MeasuredDenseOrder", "PREFERRED"]

#: Priority given to a route chosen by this table: ahead of every default position.
PREFERRED = -100.0

#: KV lengths up to this many tokens count as "text" (cross-attention to a prompt's tokens).
TEXT_KV = 1024
#: KV lengths up to this many tokens count as "short" (images), longer as "long" (video).
LONG_KV = 16384

#: (head_dim, bucket) -> dense routes, fastest first, as measured on the H200
#: (benchmarks/results/bench_h200.md; speed vs cuDNN, bf16, one run each):
#: - D=64 short (sd3_1024): fmha-v2 1.10, fa3 1.08, cuDNN 1.00 (an earlier run: 1.12, 1.12, 1.00);
#: - D=128 short (flux_1024, qwen_image_1328): fa3 0.95-1.18, cuDNN 0.99-1.04, fmha-v2 0.88-0.96;
#: - D=128 long (the Wan shapes): fa3 1.11-1.16, cuDNN 1.00, fmha-v2 1.00-1.01;
#: - D=128 text (Wan-14B cross-attention, 32,760 queries x 512 keys; benchmarks/results/hopper_cross_h200.md):
#:   cuDNN 1.00, fa3 0.77 (fmha-v2 cannot serve unequal query and key counts).
SM90_DENSE_ORDER: dict[tuple[int, str], tuple[str, ...]] = {
    (128, "text"): ("sdpa", "fa3", "fmha-v2"),
    (64, "short"): ("fmha-v2", "fa3", "sdpa"),
    (128, "short"): ("fa3", "sdpa", "fmha-v2"),
    (128, "long"): ("fa3", "sdpa", "fmha-v2"),
}


def kv_bucket(max_seqlen_kv: int) -> str:
    return "text" if max_seqlen_kv <= TEXT_KV else "short" if max_seqlen_kv <= LONG_KV else "long"


def dense_priority(call: AttentionCall, route_name: str) -> float | None:
    """``PREFERRED + rank`` when the table ranks ``route_name`` for this dense SM90 call, else None."""
    if call.skip_factor is not None or call.quant is not None or device_sm(call.q.device) != 90:
        return None
    order = SM90_DENSE_ORDER.get((call.q.shape[-1], kv_bucket(call.layout.max_seqlen_kv)))
    if order is None or route_name not in order:
        return None
    return PREFERRED + order.index(route_name)


class MeasuredDenseOrder:
    """Route mixin: on dense SM90 calls, rank by ``SM90_DENSE_ORDER``; elsewhere keep the default order."""

    name: str

    def priority(self, call: AttentionCall) -> float:
        rank = dense_priority(call, self.name)
        return super().priority(call) if rank is None else rank  # type: ignore[misc]
