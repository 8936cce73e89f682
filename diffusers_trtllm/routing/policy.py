"""When skip-softmax and SAGE pay off on a call: measured rules, so a default is never slower than dense.

A user turns the two tricks on for a whole model, but each attention call is
different: cross-attention to 512 text tokens and an image model's 4,608 tokens
gain nothing from them on Hopper, while they cost a quantization pass or a slower
kernel. Under ``policy="auto"`` (the default) a call whose request cannot pay off
runs dense on the fastest dense route instead, and the result says what was
dropped and why (the step table shows it). ``policy="always"`` honours every
request, and ``honour`` keeps named features: the processor passes what a role's
override set explicitly (``roles={"cross": {"quant": ...}}`` keeps SAGE there).

The rules hold where they were measured (H200, SM90, bf16; docs/design.md "Never
slower by default"; ``benchmarks/results/hopper_h200.md``). On other GPUs only the
short-KV skip rule applies (it follows from the skip rule itself), and on the CPU,
where the reference route is an oracle rather than a kernel to speed up, none does.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from ..config import POLICIES
from .order import LONG_KV, TEXT_KV
from .registry import AttentionCall, device_sm, get_route

__all__ = ["POLICIES", "FEATURES", "SHORT_KV", "SAGE_MIN_KV_SM90", "SAGE_INT8_MIN_KV_SM90", "SAGE_INT8_TRITON_MIN_KV_SM90", "SKIP_ALONE_MIN_SPARSITY_SM90", "SKIP_ALONE_MIN_KV_SM90",
           "PolicyDecision", "apply_policy"]


#: KV lengths up to this are "short" (text cross-attention: 512 tokens). Skip-softmax never skips
#: the first KV tile, so at most 3 of 4 tiles could go, and QK^T runs for all of them; measured on the
#: H200 (Wan-14B cross-attention, 32,760 queries x 512 keys; benchmarks/results/hopper_cross_h200.md):
#: cuDNN dense 0.73 ms, triton skip at 50% skipped 1.05 ms, triton SAGE int8 1.53 ms.
SHORT_KV = TEXT_KV

#: On SM90, SAGE pays from this KV length. Measured on the H200 (vs cuDNN, whole call with quantization):
#: Wan-14B self-attention (32,760 keys) fmha-v2-fp8 1.42x against fa3 dense 1.12x;
#: Flux (4,608 keys) fmha-v2-fp8 0.56x and triton int8 0.58x, against fa3 dense 1.03x.
SAGE_MIN_KV_SM90 = 16384

#: On SM90, int8 SAGE pays from this KV length on the project's CUDA kernel (``sage-sm90``, which ``auto``
#: ranks first for int8). Whole calls, 24 heads of 128, keys with a per-channel mean, int8 against fa3 dense, served
#: (issue 57): on an H100 8,704 keys 1.054x / 1.023x cuDNN and 4,608 keys 0.864x / 0.939x
#: (benchmarks/results/profile_call_h100_run8.md; run 6 had 8,704 a tie, 1.001x / 1.011x), 12,800 keys 1.126x /
#: 0.952x (run 6); on an H200 8,704 keys 1.050x / 0.983x (profile_call_h200_crossover.md). A whole Flux.1-dev
#: forward at 1536² (9,728 tokens) ran 1.046x faster with int8 than dense, at 1024² (4,608) the same
#: (e2e_h100_flux_int8_always.md). So it runs from 8,704, the shortest length where it measured faster.
SAGE_INT8_MIN_KV_SM90 = 8704

#: Where sage-sm90 cannot serve the call (no nvcc, a backend that names another route), int8 SAGE runs on
#: the Triton kernel, slower than fa3 dense at Wan 480p: 1.09x cuDNN against fa3's 1.12x (32,760 keys),
#: and 1.02x against 1.055x for a whole Wan-14B forward (benchmarks/results/e2e_h200_before_policy.md). At
#: 720p (75,600 keys) it ran 1.23x against fa3's 1.11x (benchmarks/results/triton_h200.md, before the
#: kernel's overflow fixes cost ~6%).
SAGE_INT8_TRITON_MIN_KV_SM90 = 65536


#: On SM90, skip-softmax without SAGE moves the call from fa3 to a skip kernel in bf16 (the gluon kernel,
#: FMHAv2 where gluon cannot serve), slower when nothing is skipped. Whole Wan forwards on the H200 against
#: fa3 dense: FMHAv2 (benchmarks/results/e2e_h200_before_policy.md) 0.90x at 0% skipped (random weights),
#: 1.03x at 44.5% (1.3B) and 1.03x at 52.9% (14B), a crossing near 34%; the run after the rule
#: (``skip-always`` in e2e_h200.md, e2e_h200_small.md) a crossing near 40%. The gluon kernel
#: (e2e_h200_gluon.md: 0.961x and 1.104x stock at 0% and 52.9%, against fa3 dense's 1.058x in
#: e2e_h200.md) crosses near 36%. So skip alone runs only where a calibrated ``target_sparsity``
#: promises at least this much; a bare threshold says nothing of the fraction.
SKIP_ALONE_MIN_SPARSITY_SM90 = 0.35

#: On SM90, skip-softmax without SAGE pays only on long KV. Flux 1024² (4,608 keys), structured weights at
#: 50% skipped tiles on the H200 (benchmarks/results/e2e_h200_flux_skip.md): gluon 1.003x and, calibrated,
#: 0.999x stock against fa3 dense's 1.004x, at about twice dense's error (rel-L1 0.0100 against 0.0058; a second
#: run, e2e_h200_flux_skip_policy.md: 1.013x against 1.011x, within the ~1% timing noise);
#: FMHAv2 earlier 0.993x at 46% (e2e_h200_small.md). The Wan forwards (32,760 keys) gain 4-6% at 50%. The
#: line is the dense order's "long" bucket (``order.LONG_KV``): between the two measured sizes.
SKIP_ALONE_MIN_KV_SM90 = LONG_KV

# Under ring attention each KV shard runs the skip rule with a running max local to the shard. A shard
# skipped about ``1 / ring_degree`` of what one process skips in the CPU simulation (structured inputs,
# reference route, ``bench.ring_skip``) and 0.91 of it in a Wan-14B 720p forward on two H200s (53.9% against
# 59.5%, benchmarks/results/cp_ring_h200x2_triton_skip.md); the rule takes the lower: the fraction a
# calibrated ``target_sparsity`` promises is divided by the number of KV shards (``AttentionCall.kv_shards``)
# before the skip-alone rule, since skip alone where little is skipped costs more (about 10%) than dense
# where skip would pay (about 3.5%; docs/design.md "Context parallelism"). (Under ring, skip alone runs on
# FMHAv2, which returns the log-sum-exp from its softmax stats (gluon does not return it); the 35% line
# was measured there.)


@dataclass(frozen=True)
class PolicyDecision:
    """The call to run, and what was dropped from the request with the reason (empty: nothing)."""

    call: AttentionCall
    dropped: tuple[str, ...] = ()

    @property
    def note(self) -> str | None:
        return "; ".join(self.dropped) or None


def _measured_device(device) -> bool:
    """The rules speak of GPU kernels; the CPU's routes are oracles (tests replace this)."""
    return device.type == "cuda"


#: The parts of a request the policy may drop, named as ``honour`` takes them.
FEATURES = ("skip", "sage")


#: The SAGE rule on SM90: the KV length SAGE pays from, and why it does not below; int8 by its kernel.
_FP8_RULE = (SAGE_MIN_KV_SM90, "quantizing costs more than it saves")
_INT8_RULES = {
    "sage-sm90": (SAGE_INT8_MIN_KV_SM90, "the shortest length where int8 SAGE (sage-sm90) measured faster than fa3 dense"),
    "triton": (SAGE_INT8_TRITON_MIN_KV_SM90, "int8 SAGE (triton) is slower than fa3 dense"),
}


def _int8_kernel(call: AttentionCall, backend: str) -> str:
    """The kernel int8 SAGE would run on for ``call`` on SM90: ``"sage-sm90"`` where it can serve it (and
    ``backend`` allows it), else ``"triton"``. This leans on ``ranked_routes`` putting sage-sm90 first for
    int8 on long keys, the only lengths where either rule keeps SAGE; ``select_route`` asks the same
    route's reasons again (microseconds, on SM90 int8 calls only) rather than being run twice here."""
    if backend in ("auto", "sage-sm90") and not get_route("sage-sm90").not_supported_reasons(call):
        return "sage-sm90"
    return "triton"


def apply_policy(call: AttentionCall, policy: str = "auto", honour: Collection[str] = (),
                 target_sparsity: float | None = None, backend: str = "auto") -> PolicyDecision:
    """Drop the parts of ``call``'s request that cannot pay off on it (``policy="auto"``).

    ``honour`` names features (``"skip"``, ``"sage"``) kept whatever the rules say: what the
    user set explicitly for this call's role. ``target_sparsity`` is the calibrated skipped
    fraction the request asks for (None: a bare threshold, fraction unknown); ``backend`` the one
    the call will be run with (the int8 SAGE rule depends on the kernel).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}.")
    unknown = set(honour) - set(FEATURES)
    if unknown:
        raise ValueError(f"honour takes {FEATURES}; got {sorted(unknown)}.")
    if policy == "always" or not _measured_device(call.q.device):
        return PolicyDecision(call)
    kv = call.layout.max_seqlen_kv
    hopper = device_sm(call.q.device) == 90
    dropped: list[str] = []
    if call.skip_factor is not None and "skip" not in honour and kv <= SHORT_KV:
        dropped.append(f"skip-softmax off: {kv} keys <= {SHORT_KV}, too few tiles to skip")
        call = replace(call, skip_factor=None)
    if call.quant is not None and "sage" not in honour and hopper:
        least, why = _INT8_RULES[_int8_kernel(call, backend)] if call.quant.dtype_qk == "int8" else _FP8_RULE
        if kv < least:
            dropped.append(f"SAGE off: {kv} keys < {least}, {why} on SM90")
            call = replace(call, quant=None)
    skip_alone = call.skip_factor is not None and call.quant is None and "skip" not in honour and hopper
    expected = None if target_sparsity is None else target_sparsity / call.kv_shards
    if skip_alone and kv < SKIP_ALONE_MIN_KV_SM90:
        dropped.append(f"skip-softmax off: alone on {kv} keys < {SKIP_ALONE_MIN_KV_SM90} it gains nothing over fa3 "
                       "dense on SM90, even at 50% skipped tiles")
        call = replace(call, skip_factor=None)
    elif skip_alone and (expected is None or expected < SKIP_ALONE_MIN_SPARSITY_SM90):
        promised = "a bare threshold" if target_sparsity is None else f"target_sparsity {target_sparsity:g}"
        if target_sparsity is not None and call.kv_shards > 1:
            promised += f", about {expected:.0%} on each of {call.kv_shards} KV shards"
        dropped.append(f"skip-softmax off: alone it runs a bf16 skip kernel (gluon or FMHAv2), slower than fa3 dense below "
                       f"{SKIP_ALONE_MIN_SPARSITY_SM90:.0%} skipped tiles on SM90 ({promised})")
        call = replace(call, skip_factor=None)
    return PolicyDecision(call, tuple(dropped))
