"""Which route ``backend="auto"`` picks, over a grid of calls: the same as the committed table.

The table (``tests/data/route_table.tsv``: one row per device, FlashInfer, dtype, head dim and layout;
one column per skip-softmax / SAGE / ring request, each cell ``auto/policy/policy at 0.5`` or one name
where the three agree, ``-`` for no route) was first written by this file's harness on the code before
route order moved into one function, and is written again (``python tests/test_route_table.py``) only
when a rank changes on purpose, the diff reviewed: since then, int8 SAGE on SM90 with long keys takes
``sage-sm90`` (16 rows), and under the policy from 32,760 keys on, where it runs dense no longer (8 rows);
since it returns the log-sum-exp, a ring shard's int8 SAGE takes it as one GPU's does (16 rows); since issue 57
(its quantizer's launches cut), int8 SAGE on SM90 takes ``sage-sm90`` at short keys too (40 rows). Devices are faked (an SM number for a CUDA device; FlashInfer importable with its
kernels built, or missing; Triton, Gluon and nvcc present), tensors are shape-only stand-ins, so no kernel
runs. Each row records the route for the call as asked, and after the never-slower policy (a bare
threshold, and ``target_sparsity=0.5``).
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diffusers_trtllm.config import QuantConfig
from diffusers_trtllm.kernels import fa3, flashinfer_support, gluon_attn, sage_sm90, triton_attn
from diffusers_trtllm.layout import PackedLayout
from diffusers_trtllm.routing import AttentionCall, NoRouteError, registry, select_route
from diffusers_trtllm.routing.policy import apply_policy

TABLE = Path(__file__).parent / "data" / "route_table.tsv"

DEVICES = ("sm80", "sm89", "sm90", "sm100", "sm120", "cpu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 96, 128, 256)
#: name -> (query lengths, key lengths, kv heads per 2 query heads)
LAYOUTS = {
    "self-4608": ((4608,), (4608,), 2),
    "self-32760": ((32760,), (32760,), 2),
    "self-75600": ((75600,), (75600,), 2),
    "cross-512": ((32760,), (512,), 2),
    "gqa-4608": ((4608,), (4608,), 1),
    "ragged-equal": ((300, 200), (300, 200), 2),
    "ragged-unequal": ((100, 50), (100, 80), 2),
}
SKIPS = ("none", "skip")
QUANTS = ("none", "int8", "fp8_e4m3")
LSES = ("none", "ring2")


@dataclass(frozen=True)
class FakeTensor:
    """What route selection reads of a tensor: its shape, dtype and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _cu(lens: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def make_call(device: str, dtype: str, head_dim: int, layout: str, skip: str, quant: str, lse: str) -> AttentionCall:
    q_lens, kv_lens, kv_heads = LAYOUTS[layout]
    packed = PackedLayout.from_cu_seqlens(_cu(q_lens), _cu(kv_lens), max(q_lens), max(kv_lens),
                                          q_tokens=sum(q_lens), kv_tokens=sum(kv_lens))
    where = torch.device("cpu") if device == "cpu" else torch.device("cuda", 0)
    q = FakeTensor((sum(q_lens), 2, head_dim), DTYPES[dtype], where)
    kv = FakeTensor((sum(kv_lens), kv_heads, head_dim), DTYPES[dtype], where)
    return AttentionCall(
        q, kv, kv, packed, 0.1,  # type: ignore[arg-type]
        skip_factor=None if skip == "none" else 1.0,
        quant=None if quant == "none" else QuantConfig(dtype_qk=quant),
        return_lse=lse != "none", kv_shards=2 if lse != "none" else 1,
    )


def fake_environment(mp: pytest.MonkeyPatch, device: str, flashinfer: str) -> None:
    """The faked GPU: its SM number, FlashInfer present with built kernels (or missing), Triton, Gluon and nvcc
    present."""
    if device != "cpu":
        mp.setattr(registry, "_sm_of", lambda index, sm=int(device[2:]): sm)
    prefill = types.SimpleNamespace(trtllm_ragged_attention_deepseek=lambda *, sage_attn_sfs=None: None)
    module = types.SimpleNamespace(prefill=prefill, trtllm_sage_attention_quantize=lambda: None)
    mp.setattr(flashinfer_support, "_import", (lambda: (module, None)) if flashinfer == "yes"
               else (lambda: (None, "ModuleNotFoundError: No module named 'flashinfer'")))
    mp.setattr(flashinfer_support, "jit_built", lambda uri: True)
    mp.setattr(fa3, "module_uri", lambda call: "fa3")
    mp.setattr(triton_attn, "_TRITON_MISSING", None)
    mp.setattr(gluon_attn, "_GLUON_MISSING", None)
    mp.setattr(sage_sm90, "sage_sm90_missing", lambda: None)  # nvcc found


def _choice(call: AttentionCall) -> str:
    try:
        return select_route(call).name
    except NoRouteError:
        return "-"


REQUESTS = tuple(itertools.product(SKIPS, QUANTS, LSES))
HEADER = ("device", "flashinfer", "dtype", "head_dim", "layout", *("+".join(r) for r in REQUESTS))


def _cell(call: AttentionCall) -> str:
    """The route as asked, after the policy with a bare threshold, and with ``target_sparsity=0.5``."""
    names = [_choice(call), *(_choice(apply_policy(call, target_sparsity=s).call) for s in (None, 0.5))]
    return names[0] if len(set(names)) == 1 else "/".join(names)


def rows() -> list[tuple[str, ...]]:
    out = []
    for device, flashinfer in itertools.product(DEVICES, ("yes", "no")):
        with pytest.MonkeyPatch.context() as mp:
            fake_environment(mp, device, flashinfer)
            for dtype, dim, layout in itertools.product(DTYPES, HEAD_DIMS, LAYOUTS):
                cells = [_cell(make_call(device, dtype, dim, layout, *request)) for request in REQUESTS]
                out.append((device, flashinfer, dtype, str(dim), layout, *cells))
    return out


def _table() -> list[tuple[str, ...]]:
    return [tuple(line.split("\t")) for line in TABLE.read_text().splitlines()]


def test_route_choice_is_unchanged():
    header, *expected = _table()
    assert header == HEADER
    got = rows()
    assert len(got) == len(expected)
    changed = [(e, g) for e, g in zip(expected, got) if e != g]
    assert not changed, f"{len(changed)} rows changed, first: {changed[:3]}"


def test_table_covers_every_route_that_auto_may_pick():
    chosen = {name for row in _table()[1:] for cell in row[5:] for name in cell.split("/")}
    assert chosen == {"trtllm-gen", "fa3", "fmha-v2", "fmha-v2-fp8", "sage-sm90", "triton", "gluon", "sdpa", "-"}


if __name__ == "__main__":
    TABLE.write_text("".join("\t".join(row) + "\n" for row in [HEADER, *rows()]))
