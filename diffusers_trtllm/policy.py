"""When skip-softmax and SAGE pay off on a call: measured rules, so a default is never slower than dense.

A user turns the two tricks on for a whole model, but each attention call is
different: cross-attention to 512 text tokens and an image model's 4,608 tokens
gain nothing from them on Hopper, while they cost a quantization pass or a slower
kernel. Under ``policy="auto"`` (the default) a call whose request cannot pay off
runs dense on the fastest dense route instead, and the result says what was
dropped and why (the step table shows it). ``policy="always"`` honours every
request; the processor uses it for a role the user configured explicitly
(``roles={"cross": {...}}``).

The rules hold where they were measured (H200, SM90, bf16; docs/design.md "Never
slower by default"; ``benchmarks/results/hopper_h200.md``). On other GPUs only the
short-KV skip rule applies (it follows from the skip rule itself), and on the CPU,
where the reference route is an oracle rather than a kernel to speed up, none does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .kernels._dense_order import TEXT_KV
from .routes import AttentionCall, device_sm

__all__ = ["POLICIES", "SHORT_KV", "SAGE_MIN_KV_SM90", "PolicyDecision", "apply_policy"]

POLICIES = ("auto", "always")

#: KV lengths up to this are "short" (text cross-attention: 512 tokens). Skip-softmax never skips
#: the first KV tile, so at most 3 of 4 tiles could go, and QK^T runs for all of them; measured on the
#: H200 (Wan-14B cross-attention, 32,760 queries x 512 keys): cuDNN dense 0.73 ms, triton skip at 50%
#: skipped 1.05 ms, triton SAGE int8 1.53 ms.
SHORT_KV = TEXT_KV

#: On SM90, SAGE pays from this KV length. Measured on the H200 (vs cuDNN, whole call with quantization):
#: Wan-14B self-attention (32,760 keys) fmha-v2-fp8 1.43x and triton int8 1.16x, against fa3 dense 1.13x;
#: Flux (4,608 keys) 0.54x and 0.49x, against fa3 dense 1.06x.
SAGE_MIN_KV_SM90 = 16384


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


def apply_policy(call: AttentionCall, policy: str = "auto") -> PolicyDecision:
    """Drop the parts of ``call``'s request that cannot pay off on it (``policy="auto"``)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}; got {policy!r}.")
    if policy == "always" or not _measured_device(call.q.device):
        return PolicyDecision(call)
    kv = call.layout.max_seqlen_kv
    dropped: list[str] = []
    if call.skip_factor is not None and kv <= SHORT_KV:
        dropped.append(f"skip-softmax off: {kv} keys <= {SHORT_KV}, too few tiles to skip")
        call = replace(call, skip_factor=None)
    if call.quant is not None and device_sm(call.q.device) == 90 and kv < SAGE_MIN_KV_SM90:
        dropped.append(f"SAGE off: {kv} keys < {SAGE_MIN_KV_SM90}, quantizing costs more than it saves on SM90")
        call = replace(call, quant=None)
    return PolicyDecision(call, tuple(dropped))
