"""Ragged ("packed") layout: from ``[batch, tokens, heads, dim]`` to the kernels' varlen form.

Kernels take ``[tokens, heads, dim]`` with int32 ``cu_seqlens`` and max lengths as
Python ints. Valid tokens are gathered wherever they sit (Qwen-Image pads text
in the middle of ``[text | image]``), so a mask is never assumed to be a prefix.
Host-side lengths cost one device sync, done once per distinct mask (``LayoutCache``).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

__all__ = ["PackedLayout", "LayoutCache", "MaskNotSupportedError", "key_padding_mask", "query_key_masks"]

#: Additive-mask values at or below this count as "masked out" (their exp() is 0 in fp32 anyway);
#: not -1e4, because LTX's ``-10000.0`` mask becomes -9984 in bf16.
_ADDITIVE_MASKED = -1.0e3


class MaskNotSupportedError(ValueError):
    """The mask is not a key-padding mask (it varies per query or head, or is a bias)."""


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """Where each sequence's tokens live in a flattened ragged batch.

    ``q_index`` / ``kv_index`` hold the flat ``batch * len`` positions of the valid
    tokens, or ``None`` when every token is valid (packing is then a reshape).
    """

    batch: int
    q_len: int
    kv_len: int
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    seq_lens_kv: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    min_seqlen_kv: int
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    q_index: torch.Tensor | None = None
    kv_index: torch.Tensor | None = None

    # ---- construction -------------------------------------------------
    @classmethod
    def dense(cls, batch: int, q_len: int, kv_len: int, device: torch.device | str) -> "PackedLayout":
        """Every token valid: ``batch`` sequences of ``q_len`` queries and ``kv_len`` keys."""
        if batch < 1 or q_len < 1 or kv_len < 1:
            raise ValueError(f"batch, q_len and kv_len must be >= 1; got {batch}, {q_len}, {kv_len}.")
        return cls._from_lengths(batch, q_len, kv_len, [q_len] * batch, [kv_len] * batch, None, None, device)

    @classmethod
    def from_masks(
        cls,
        batch: int,
        q_len: int,
        kv_len: int,
        *,
        kv_mask: torch.Tensor | None = None,
        q_mask: torch.Tensor | None = None,
    ) -> "PackedLayout":
        """From boolean ``[batch, len]`` masks (True = valid token).

        Without ``q_mask`` every query is kept (its output equals masked SDPA's);
        with it, padded queries are dropped and come back as zero rows. A sequence
        with no valid key also comes back as zero rows, as torch's SDPA returns for
        fully masked rows; a batch with no valid key at all raises ``MaskNotSupportedError``.
        """
        masks = [(name, m, n) for name, m, n in (("q_mask", q_mask, q_len), ("kv_mask", kv_mask, kv_len)) if m is not None]
        for name, m, n in masks:
            if m.dtype != torch.bool or tuple(m.shape) != (batch, n):
                raise ValueError(f"{name} must be a bool tensor of shape {(batch, n)}; got {m.dtype} {tuple(m.shape)}.")
        if not masks:
            raise ValueError("from_masks needs q_mask, kv_mask or both; use PackedLayout.dense for no mask.")
        device = masks[0][1].device
        # One sync for all host-side lengths.
        counts = torch.stack([m.sum(dim=1, dtype=torch.int64) for _, m, _ in masks]).tolist()
        lens = {name: c for (name, _, _), c in zip(masks, counts)}
        q_lens = lens.get("q_mask", [q_len] * batch)
        kv_lens = lens.get("kv_mask", [kv_len] * batch)
        keep = [i for i in range(batch) if kv_lens[i] > 0 or q_lens[i] == 0]
        if not keep:
            raise MaskNotSupportedError(
                "the masks leave no sequence with both a query and a valid key; attention over zero keys has no "
                "kernel to run (torch's SDPA returns zeros there)."
            )
        if len(keep) < batch:  # drop sequences with queries but no key: their rows come back as zeros
            rows = torch.zeros(batch, dtype=torch.bool, device=device)
            rows[keep] = True
            q_mask = (q_mask if q_mask is not None else torch.ones(batch, q_len, dtype=torch.bool, device=device)) & rows[:, None]
            kv_mask = (kv_mask if kv_mask is not None else torch.ones(batch, kv_len, dtype=torch.bool, device=device)) & rows[:, None]
            q_lens, kv_lens = [q_lens[i] for i in keep], [kv_lens[i] for i in keep]

        def index(m: torch.Tensor | None, total: int) -> torch.Tensor | None:
            if m is None or total == m.numel():
                return None
            return torch.nonzero_static(m.reshape(-1), size=total).reshape(-1)

        return cls._from_lengths(
            batch, q_len, kv_len, q_lens, kv_lens, index(q_mask, sum(q_lens)), index(kv_mask, sum(kv_lens)), device
        )

    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_kv: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_kv: int,
        *,
        q_tokens: int,
        kv_tokens: int,
        valid_q_tokens: int | None = None,
        valid_kv_tokens: int | None = None,
    ) -> "PackedLayout":
        """From explicit varlen metadata over an already packed ``[tokens, ...]`` tensor.

        ``valid_q_tokens`` / ``valid_kv_tokens`` are the suffix-padding shortcut: the
        first that many tokens form one sequence, the rest is padding, and
        ``cu_seqlens`` must then be the canonical ``[0, valid]``.
        """
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be a Python int (no device sync inside a layer); got {value!r}.")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
            if not isinstance(cu, torch.Tensor) or cu.ndim != 1:
                raise ValueError(f"{name} must be a one-dimensional tensor; got {getattr(cu, 'shape', cu)!r}.")
            if cu.dtype != torch.int32:
                raise ValueError(f"{name} must be int32; got {cu.dtype}.")
        if cu_seqlens_q.numel() != cu_seqlens_kv.numel() or cu_seqlens_q.numel() < 2:
            raise ValueError(
                "cu_seqlens_q and cu_seqlens_kv must have the same number (>= 2) of entries; "
                f"got {cu_seqlens_q.numel()} and {cu_seqlens_kv.numel()}."
            )
        if cu_seqlens_q.device != cu_seqlens_kv.device:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_kv must share a device; got {cu_seqlens_q.device}, {cu_seqlens_kv.device}.")
        cq, ckv = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
        if valid_q_tokens is not None or valid_kv_tokens is not None:
            for name, valid, total in (("valid_q_tokens", valid_q_tokens, q_tokens), ("valid_kv_tokens", valid_kv_tokens, kv_tokens)):
                if isinstance(valid, bool) or not isinstance(valid, int) or not 0 < valid <= total:
                    raise ValueError(f"{name} must be a Python int in [1, {total}]; got {valid!r}.")
            if cq != [0, valid_q_tokens] or ckv != [0, valid_kv_tokens]:
                raise ValueError(
                    "suffix-padding metadata needs canonical cu_seqlens [0, valid]; got "
                    f"cu_seqlens_q={cq}, cu_seqlens_kv={ckv} for valid lengths {valid_q_tokens}, {valid_kv_tokens}."
                )
            if max_seqlen_q != valid_q_tokens or max_seqlen_kv != valid_kv_tokens:
                raise ValueError(
                    f"max_seqlen_q/kv ({max_seqlen_q}, {max_seqlen_kv}) must equal the valid lengths "
                    f"({valid_q_tokens}, {valid_kv_tokens}) with suffix padding."
                )
        elif cq[-1] != q_tokens or ckv[-1] != kv_tokens:
            raise ValueError(
                f"cu_seqlens must cover all tokens: they end at {cq[-1]} (q) and {ckv[-1]} (kv) "
                f"but the tensors hold {q_tokens} and {kv_tokens} tokens."
            )
        for name, cu in (("cu_seqlens_q", cq), ("cu_seqlens_kv", ckv)):
            if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"{name} must start at 0 and never decrease; got {cu}.")
        # A producer may keep zero-length trailing segments: they are not sequences.
        while len(cq) > 2 and cq[-1] == cq[-2] and ckv[-1] == ckv[-2]:
            cq, ckv = cq[:-1], ckv[:-1]
        q_lens = [b - a for a, b in zip(cq, cq[1:])]
        kv_lens = [b - a for a, b in zip(ckv, ckv[1:])]
        if max(q_lens) > max_seqlen_q or max(kv_lens) > max_seqlen_kv:
            raise ValueError(
                f"max_seqlen_q/kv ({max_seqlen_q}, {max_seqlen_kv}) are smaller than the longest sequences "
                f"({max(q_lens)}, {max(kv_lens)})."
            )
        empty = [i for i, (a, b) in enumerate(zip(q_lens, kv_lens)) if b == 0 and a > 0]
        if empty:
            raise ValueError(f"sequences {empty} have queries but no keys; attention over zero keys is undefined.")
        layout = cls._from_lengths(1, q_tokens, kv_tokens, q_lens, kv_lens, None, None, cu_seqlens_q.device)
        return layout

    @classmethod
    def _from_lengths(cls, batch, q_len, kv_len, q_lens, kv_lens, q_index, kv_index, device) -> "PackedLayout":
        def cu(lens: list[int]) -> torch.Tensor:
            out = [0]
            for n in lens:
                out.append(out[-1] + n)
            return torch.tensor(out, dtype=torch.int32).to(device, non_blocking=True)

        cu_q, cu_kv = cu(q_lens), cu(kv_lens)
        return cls(
            batch=batch,
            q_len=q_len,
            kv_len=kv_len,
            cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_kv,
            seq_lens_kv=(cu_kv[1:] - cu_kv[:-1]).contiguous(),
            max_seqlen_q=max(q_lens),
            max_seqlen_kv=max(kv_lens),
            min_seqlen_kv=min(kv_lens),
            q_lens=tuple(q_lens),
            kv_lens=tuple(kv_lens),
            q_index=q_index,
            kv_index=kv_index,
        )

    # ---- use ----------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @functools.cached_property
    def total_q(self) -> int:
        return sum(self.q_lens)

    @functools.cached_property
    def total_kv(self) -> int:
        return sum(self.kv_lens)

    @functools.cached_property
    def in_place(self) -> bool:
        """Every token of the flattened batch is valid, in order: packing is a flatten, with no index or slice."""
        return (self.q_index is None and self.kv_index is None and self.total_q == self.batch * self.q_len
                and self.total_kv == self.batch * self.kv_len)

    def pack(self, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``pack_q(query), pack_kv(key), pack_kv(value)`` of tensors this layout describes (``run_attention``
        checks them): an in-place layout's are one flatten each, about half ``pack_q``'s CPU time (issue 57)."""
        if self.in_place:
            return query.flatten(0, -3).contiguous(), key.flatten(0, -3).contiguous(), value.flatten(0, -3).contiguous()
        return self.pack_q(query), self.pack_kv(key), self.pack_kv(value)

    def pack_q(self, x: torch.Tensor) -> torch.Tensor:
        """``[batch, q_len, heads, dim]`` (or already ``[tokens, heads, dim]``) to ``[total_q, heads, dim]``."""
        return _pack(x, self.q_index, self.total_q)

    def pack_kv(self, x: torch.Tensor) -> torch.Tensor:
        return _pack(x, self.kv_index, self.total_kv)

    def unpack_q(self, out: torch.Tensor) -> torch.Tensor:
        """``[total_q, heads, dim]`` back to ``[batch, q_len, heads, dim]``; padded queries are zero rows."""
        tokens, heads, dim = out.shape
        flat_len = self.batch * self.q_len
        if self.q_index is None and tokens == flat_len:
            return out.reshape(self.batch, self.q_len, heads, dim)
        full = out.new_zeros(flat_len, heads, dim)
        if self.q_index is None:
            full[: out.shape[0]] = out
        else:
            full.index_copy_(0, self.q_index, out)
        return full.reshape(self.batch, self.q_len, heads, dim)


def _pack(x: torch.Tensor, index: torch.Tensor | None, total: int) -> torch.Tensor:
    flat = x.flatten(0, -3)  # one call: reshape(-1, *x.shape[-2:]) reads the shape first (issue 57)
    if index is not None:
        return flat.index_select(0, index)
    return flat[:total].contiguous() if flat.shape[0] != total else flat.contiguous()


def _mask_4d(attn_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The mask, checked, as the 4-D shape SDPA broadcasts it to (values unchanged)."""
    m = attn_mask
    if m.ndim < 1 or m.ndim > 4 or m.shape[-1] != kv_len:
        raise MaskNotSupportedError(
            f"attention mask of shape {tuple(m.shape)} does not end in kv_len={kv_len}; "
            "expected [batch, kv_len] or a shape broadcastable to [batch, heads, q_len, kv_len]."
        )
    if m.dtype != torch.bool and not m.is_floating_point():
        raise MaskNotSupportedError(f"attention mask must be bool or floating point; got {m.dtype}.")
    if m.ndim == 2 and m.shape[0] == q_len == batch > 1 and not bool((m == m[:1]).all()):
        raise MaskNotSupportedError(
            f"a 2-D attention mask of shape {tuple(m.shape)} is ambiguous when batch == q_len == {batch}: "
            "[batch, kv_len] key padding or SDPA's [q_len, kv_len]. Pass key padding as [batch, 1, 1, kv_len] "
            "or a per-query mask as [1, 1, q_len, kv_len] (per-query masks run on backend='sdpa')."
        )
    # [batch, kv_len] is a key-padding mask; 3-D and 4-D masks broadcast as in SDPA.
    return m[:, None, None, :] if m.ndim == 2 else m.reshape((1,) * (4 - m.ndim) + tuple(m.shape))


def _keep_rows(rows: torch.Tensor) -> torch.Tensor:
    """Bool rows (True = attend) from bool or additive rows over the keys (the last dim).

    Additive rows hold 0 (attend) and large negatives (masked). A row with one finite value
    on every key (Cosmos passes ones, LTX-Video -10000 for an empty prompt) shifts all
    scores alike, so stock attention attends to every key: so do we.
    """
    if rows.dtype == torch.bool:
        return rows
    keep = rows == 0
    constant = (rows == rows[..., :1]).all(dim=-1) & torch.isfinite(rows).all(dim=-1)
    if not bool((keep | (rows <= _ADDITIVE_MASKED) | constant[..., None]).all()):
        raise MaskNotSupportedError(
            "additive attention mask holds values other than 0 and large negatives: it is a bias, "
            "not a padding mask; use a route that takes masks (backend='sdpa')."
        )
    if bool((~keep.any(dim=-1) & torch.isfinite(rows).any(dim=-1) & ~constant).any()):
        raise MaskNotSupportedError(
            "an additive mask row masks every key with different finite values: softmax then weighs the keys "
            "by those values (a bias); use a route that takes masks (backend='sdpa')."
        )
    return keep | constant[..., None]


def key_padding_mask(attn_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """Reduce an attention mask to a boolean ``[batch, kv_len]`` key-padding mask (True = valid).

    Accepts bool masks (True = attend) and additive masks holding only 0 and large
    negative values: ``[batch, kv_len]``, or any shape that broadcasts to
    ``[batch, heads, q_len, kv_len]`` and is the same for every head and query.
    A 2-D mask is read as ``[batch, kv_len]``; when ``batch == q_len`` it could as well
    be SDPA's ``[q_len, kv_len]``, so unless its rows agree it is refused. A row with one
    finite value on every key attends to every key (see ``_keep_rows``).
    Raises ``MaskNotSupportedError`` when the mask varies per query or head, or is a bias.
    """
    m = _mask_4d(attn_mask, batch, q_len, kv_len)
    if m.shape[0] not in (1, batch):
        raise MaskNotSupportedError(f"attention mask batch dim {m.shape[0]} does not match batch={batch}.")
    if m.shape[1] != 1 or m.shape[2] != 1:
        first = m[:, :1, :1, :]
        if not bool((m == first).all()):
            raise MaskNotSupportedError(
                "attention mask varies per query or head, so it is not a key-padding mask; "
                "use a route that takes masks (backend='sdpa')."
            )
        m = first
    return _keep_rows(m[:, 0, 0, :]).expand(batch, kv_len)


def query_key_masks(attn_mask: torch.Tensor, batch: int, q_len: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a mask (the same for every head) into bool ``([batch, q_len], [batch, kv_len])`` masks:
    the keys any query may attend, and the queries whose row attends exactly those keys.

    Every other query (a padded one) may attend to at most one key; those get the stock
    kernel's rows. Chroma's and HunyuanVideo 1.5's masks are outer products of query and
    key padding (a padded query attends to nothing); HunyuanVideo's token refiner lets a
    padded query attend to the first key. Raises ``MaskNotSupportedError`` for anything
    else (a causal or banded mask, a mask that varies per head).
    """
    m = _mask_4d(attn_mask, batch, q_len, kv_len)
    if m.shape[0] not in (1, batch) or m.shape[2] not in (1, q_len):
        raise MaskNotSupportedError(f"attention mask of shape {tuple(attn_mask.shape)} does not fit batch={batch}, q_len={q_len}.")
    if m.shape[1] != 1 and not bool((m == m[:, :1]).all()):
        raise MaskNotSupportedError("attention mask varies per head; use a route that takes masks (backend='sdpa').")
    m = _keep_rows(m[:, 0]).expand(batch, q_len, kv_len)
    kv_mask = m.any(dim=1)
    q_mask = (m == kv_mask[:, None, :]).all(dim=2)
    if bool(((m.sum(dim=2) > 1) & ~q_mask).any()):
        raise MaskNotSupportedError(
            "attention mask varies per query (causal or banded: a query outside the padding attends to its own "
            "set of keys), so it is not a padding mask; use a route that takes masks (backend='sdpa')."
        )
    return q_mask, kv_mask


class LayoutCache:
    """Remembers the layout built for a mask tensor, so all layers of a forward share one sync.

    Entries are keyed by the mask object itself (held weakly, with its version
    counter), so a freed or modified mask never returns a stale layout. A tensor made
    under ``torch.inference_mode()`` has no version counter: it is keyed by its storage
    and shape instead (an in-place edit of one inside inference mode is not seen; pass a
    new mask). Unmasked (dense) layouts are kept per shape. Both hold at most
    ``max_entries``, oldest dropped first.
    """

    def __init__(self, max_entries: int = 8) -> None:
        self._entries: dict[Hashable, tuple[weakref.ref, int, Any]] = {}
        self._dense: dict[Hashable, PackedLayout] = {}
        self._max = max_entries

    def get(self, mask: torch.Tensor, extra_key: Hashable, build: Callable[[], Any]) -> Any:
        key = (id(mask), extra_key)
        version = _version(mask)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is mask and hit[1] == version:
            return hit[2]
        layout = build()
        _bounded_put(self._entries, key, (weakref.ref(mask), version, layout), self._max)
        return layout

    def dense(self, batch: int, q_len: int, kv_len: int, device: torch.device) -> PackedLayout:
        """``PackedLayout.dense`` for this shape, built once."""
        key = (batch, q_len, kv_len, device)
        layout = self._dense.get(key)
        if layout is None:
            layout = PackedLayout.dense(batch, q_len, kv_len, device)
            _bounded_put(self._dense, key, layout, self._max)
        return layout

    def __len__(self) -> int:
        return len(self._entries) + len(self._dense)


def _version(tensor: torch.Tensor) -> Hashable:
    """What changes when ``tensor`` is modified in place: its version counter, or for an inference tensor
    (which has none) its storage and shape."""
    if torch.is_inference(tensor):
        return ("inference", tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
    return tensor._version


def _bounded_put(entries: dict, key: Hashable, value: Any, limit: int) -> None:
    entries.pop(key, None)
    while len(entries) >= limit:
        entries.pop(next(iter(entries)), None)
    entries[key] = value
