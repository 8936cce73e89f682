"""Benchmark inputs: the standard shapes, a seeded generator with local structure, and real Q/K/V.

Random Gaussian Q/K give flat attention, where skip-softmax skips nothing. The
generator here plants the two structures real diffusion attention shows, with
one knob, ``locality`` in [0, 1]:

* locality: token ``t`` sits on a grid (frames x height x width for video, rows
  x columns for images); Q and K share random Fourier features of that position,
  so a query's logit to a key ``d`` grid cells away rises by about
  ``24 * locality * exp(-d^2 / (2 * 2^2))`` nats (length scale 2 cells);
* a sink: the first 64 keys get ``24 * locality - 2`` nats on every query, the
  strong early keys that let a running max form in the first KV tile.

On top sits i.i.d. Gaussian noise of unit logit variance, as with plain random
inputs; ``locality=0`` is exactly those. Larger ``locality`` means sharper
attention and more skippable tiles at a given threshold.

Trained video models' heads also differ in how far they attend: ``reach_spread``
gives head ``h`` of ``H`` the length scale ``2 * 2**(reach_spread * (2h / (H - 1) - 1))``
cells (0: every head 2 cells), so some heads have many skippable tiles and others few.

Trained models' keys and values also carry a per-(head, channel) mean shared by
every token, which random weights lack: ``k_mean`` / ``v_mean`` add one, that many
times the tensor's own spread. Softmax ignores K's (it shifts a query's logits
alike), but quantization does not (SageAttention's reason to smooth K).

Real attention: ``save_qkv`` writes Q/K/V with metadata, ``capture_qkv`` records
what an attention call sees inside a pipeline, and ``load_qkv`` reads them back.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..layout import PackedLayout

__all__ = ["Shape", "SHAPES", "parse_shapes", "structured_qkv", "holed_batch", "save_qkv", "load_qkv", "capture_qkv",
           "spy_sdpa"]

#: Logit contrast (nats) at ``locality=1`` between a query's own position and an unrelated key.
MAX_CONTRAST = 24.0
#: Length scale of the positional similarity, in grid cells.
LENGTH_SCALE = 2.0
#: Keys at the start of the sequence that every query attends to.
SINK_TOKENS = 64


@dataclass(frozen=True)
class Shape:
    """One attention call: ``batch`` sequences of ``tokens`` (self-attention unless ``kv_tokens``)."""

    name: str
    batch: int
    tokens: int
    heads: int
    head_dim: int
    #: Token grid of one sequence (row-major), for the generator's positions.
    grid: tuple[int, ...] = field(default=())
    kv_tokens: int | None = None

    @property
    def kv_len(self) -> int:
        return self.kv_tokens or self.tokens

    def flops(self) -> float:
        """``4 * B * H * Sq * Skv * D``: the two matrix products of attention."""
        return 4.0 * self.batch * self.heads * self.tokens * self.kv_len * self.head_dim


def _image_grid(tokens: int, width: int = 64) -> tuple[int, int]:
    return (-(-tokens // width), width)


#: The standard shapes of docs/design.md (bf16, non-causal), plus a tiny one for CPU smoke tests.
SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("flux_1024", 1, 4608, 24, 128, _image_grid(4608)),
        Shape("qwen_image_1328", 1, 7193, 24, 128, _image_grid(7193)),
        Shape("wan_1.3b_480p", 1, 32760, 12, 128, (21, 30, 52)),
        Shape("wan_14b_480p", 1, 32760, 40, 128, (21, 30, 52)),
        Shape("wan_14b_720p", 1, 75600, 40, 128, (21, 45, 80)),
        Shape("sd3_1024", 1, 4429, 24, 64, _image_grid(4429)),
        Shape("tiny", 1, 512, 2, 64, (16, 32)),
    )
}
STANDARD_SHAPES = ("flux_1024", "qwen_image_1328", "wan_1.3b_480p", "wan_14b_480p", "wan_14b_720p", "sd3_1024")


def parse_shapes(spec: str) -> list[Shape]:
    """``"flux_1024,wan_14b_480p"``, ``"standard"``, or custom ``"name=B:S:H:D[:KV]"`` entries (KV: key tokens)."""
    shapes = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item == "standard":
            shapes += [SHAPES[n] for n in STANDARD_SHAPES]
        elif "=" in item:
            name, dims = item.split("=", 1)
            try:
                b, s, h, d, *kv = (int(x) for x in dims.split(":"))
                if len(kv) > 1:
                    raise ValueError
            except ValueError:
                raise ValueError(f"custom shape {item!r} must read name=BATCH:TOKENS:HEADS:HEAD_DIM[:KV_TOKENS]") from None
            shapes.append(Shape(name, b, s, h, d, _image_grid(s), kv_tokens=kv[0] if kv else None))
        elif item in SHAPES:
            shapes.append(SHAPES[item])
        else:
            raise ValueError(f"unknown shape {item!r}; choose from {sorted(SHAPES)}, 'standard' or name=B:S:H:D")
    return shapes


def _positions(tokens: int, grid: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``[tokens, len(grid)]`` float grid coordinates of each token (row-major)."""
    grid = grid or (tokens,)
    t = torch.arange(tokens, device=device)
    coords = []
    for size in reversed(grid[1:]):
        coords.append(t % size)
        t = t // size
    coords.append(t)
    return torch.stack(coords[::-1], dim=1).float()


def structured_qkv(
    shape: Shape,
    locality: float = 0.5,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    k_mean: float = 0.0,
    v_mean: float = 0.0,
    reach_spread: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded ``[batch, tokens, heads, head_dim]`` Q, K, V with local structure and, where ``k_mean`` /
    ``v_mean`` ask, a per-channel mean of that many standard deviations of K / V, and with heads whose reach
    differs by ``reach_spread`` octaves either way (module docstring)."""
    if not 0.0 <= locality <= 1.0:
        raise ValueError(f"locality must be in [0, 1]; got {locality!r}.")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    b, h, d = shape.batch, shape.heads, shape.head_dim

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32)

    # Unit-variance logits from noise alone: q.k * d**-0.5 with q, k ~ N(0, 1).
    q, k, v = randn(b, shape.tokens, h, d), randn(b, shape.kv_len, h, d), randn(b, shape.kv_len, h, d)
    contrast = MAX_CONTRAST * locality
    if contrast > 0:
        # Random Fourier features: phi(p) . phi(p') ~ exp(-|p - p'|^2 / (2 l^2)), |phi| ~ 1.
        grid = shape.grid if math.prod(shape.grid or (0,)) >= max(shape.tokens, shape.kv_len) else ()
        n_axes = len(grid) or 1
        octaves = torch.linspace(-1.0, 1.0, h, device=device) * reach_spread
        freqs = randn(h, d, n_axes) / (LENGTH_SCALE * 2.0**octaves)[:, None, None]
        phase = torch.rand(h, d, generator=gen, device=device) * (2 * math.pi)
        amp = math.sqrt(contrast) * d**0.25  # (amp * phi) . (amp * phi') * d**-0.5 = contrast * kernel

        def features(tokens: int) -> torch.Tensor:
            pos = _positions(tokens, grid, device)  # [T, axes]
            return torch.cos(torch.einsum("ta,hda->thd", pos, freqs) + phase) * math.sqrt(2.0 / d) * amp

        q += features(shape.tokens)
        k += features(shape.kv_len)
        sink_dir = torch.nn.functional.normalize(randn(h, d), dim=-1)
        sink_amp = math.sqrt(max(contrast - 2.0, 0.0)) * d**0.25
        q += sink_amp * sink_dir
        k[:, :SINK_TOKENS] += sink_amp * sink_dir
    if k_mean:
        k += k_mean * k.std() * randn(h, d)
    if v_mean:
        v += v_mean * v.std() * randn(h, d)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def save_qkv(path: str | Path, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **meta: Any) -> None:
    """Save ``[batch, tokens, heads, head_dim]`` Q/K/V (on the CPU) and metadata for ``--qkv-file``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [batch, tokens, heads, head_dim]; got shape {tuple(x.shape)}.")
    torch.save({"q": q.detach().cpu(), "k": k.detach().cpu(), "v": v.detach().cpu(), "meta": meta}, path)


def load_qkv(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Read what ``save_qkv`` wrote: Q, K, V and the metadata dict."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    missing = {"q", "k", "v"} - set(data)
    if missing:
        raise ValueError(f"{path} is not a save_qkv file: it lacks {sorted(missing)}.")
    return data["q"], data["k"], data["v"], dict(data.get("meta", {}))


@contextlib.contextmanager
def spy_sdpa(observe: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
    """Inside the block, ``observe(call_index, q, k, v)`` sees every SDPA call before it runs.

    Wraps ``torch.nn.functional.scaled_dot_product_attention`` (what Diffusers' stock
    processors and its native backend call), whose inputs are ``[batch, heads, tokens, dim]``.
    ``observe`` may raise to stop the caller (the end-to-end probe stops a forward that way).
    """
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    calls = 0

    def spy(query, key, value, *args, **kwargs):
        nonlocal calls
        index, calls = calls, calls + 1
        observe(index, query, key, value)
        return original(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def holed_batch(
    *,
    seq: int = 1536,
    kv_valid: tuple[int, ...] = (1536, 1000, 700),
    heads: int = 4,
    kv_heads: int | None = None,
    head_dim: int = 128,
    queries: str = "equal",
    locality: float = 0.5,
    seed: int = 1,
    device: torch.device | str = "cuda",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PackedLayout]:
    """A ragged test batch: row ``b`` keeps ``kv_valid[b]`` keys, with the padded ones in the middle.

    Returns structured ``[batch, seq, heads, dim]`` Q/K/V (K/V with ``kv_heads``) and the layout.
    ``queries``: ``"equal"`` keeps queries where keys are valid (as many queries as keys),
    ``"more"`` keeps every query, ``"fewer"`` also drops 100 queries from the first row.
    """
    if queries not in ("equal", "more", "fewer"):
        raise ValueError(f"queries must be 'equal', 'more' or 'fewer'; got {queries!r}.")
    q, k, v = structured_qkv(Shape("holed", len(kv_valid), seq, heads, head_dim, (32, 48)), locality, seed=seed, device=device)
    kv_heads = kv_heads or heads
    k, v = k[:, :, :kv_heads].contiguous(), v[:, :, :kv_heads].contiguous()
    kv_mask = torch.zeros(len(kv_valid), seq, dtype=torch.bool, device=device)
    for b, n in enumerate(kv_valid):
        kv_mask[b, : seq // 3] = True
        kv_mask[b, seq // 3 + seq - n :] = True
    q_mask = None if queries == "more" else kv_mask.clone()
    if queries == "fewer":
        q_mask[0, -100:] = False
    return q, k, v, PackedLayout.from_masks(len(kv_valid), seq, seq, kv_mask=kv_mask, q_mask=q_mask)


@contextlib.contextmanager
def capture_qkv(path: str | Path, *, call_index: int = 0, **meta: Any) -> Iterator[dict[str, Any]]:
    """Inside the block, save the Q/K/V of the ``call_index``-th SDPA call to ``path`` (see ``spy_sdpa``).

    Yields a dict that receives ``saved=True`` once the tensors are written.
    """
    state: dict[str, Any] = {"saved": False}

    def observe(index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if index == call_index:
            t = lambda x: x.transpose(1, 2)  # noqa: E731 - to [batch, tokens, heads, dim]
            save_qkv(path, t(query), t(key), t(value), call_index=call_index, **meta)
            state["saved"] = True

    with spy_sdpa(observe):
        yield state
