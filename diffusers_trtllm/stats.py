"""Per-layer, per-step statistics of served attention calls, bounded in memory.

Each layer keeps one :class:`StepRecord` per denoising step (calls of that step are
added into it), in a :class:`LayerStats` that holds at most ``max_steps`` steps and
drops the oldest first. So memory stays bounded whether or not a timestep is tracked
(without one, a layer's n-th call is its step n). A new run (a timestep tracker
seeing ``t`` rise) starts the layer's statistics afresh.

The data is plain: :func:`layer_step_rows` gives one dict per (layer, step) with the
columns ``layer, role, step, t, route, sparse, skipped_fraction, sage, calls, note``;
:func:`step_table` sums them per step for :func:`format_step_table`. See docs/design.md.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["StepRecord", "LayerStats", "layer_step_rows", "step_table", "format_step_table", "MAX_STEPS"]

#: Steps a layer remembers (a run of 1,000 steps fits; older steps are dropped first).
MAX_STEPS = 1024


@dataclass
class StepRecord:
    """What one layer's calls did during one step (usually one call per step)."""

    step: int
    t: float | None
    calls: int = 0
    sparse_calls: int = 0
    sage_calls: int = 0
    skipped_tiles: int | None = None
    total_tiles: int | None = None
    #: Route name -> calls it ran.
    routes: dict[str, int] = field(default_factory=dict)
    #: What the policy dropped from the request on these calls, and why (``policy.apply_policy``).
    notes: set[str] = field(default_factory=set)

    @property
    def route(self) -> str:
        """The route(s) that ran, comma-separated (one in the usual case)."""
        return ",".join(sorted(self.routes))

    @property
    def sparse(self) -> bool:
        return self.sparse_calls > 0

    @property
    def sage(self) -> bool:
        return self.sage_calls > 0

    @property
    def skipped_fraction(self) -> float | None:
        return self.skipped_tiles / self.total_tiles if self.total_tiles else None

    @property
    def note(self) -> str | None:
        return "; ".join(sorted(self.notes)) or None

    def add(self, route: str, sparse: bool, sage: bool, skipped_tiles: int | None, total_tiles: int | None,
            note: str | None = None) -> None:
        self.calls += 1
        if note:
            self.notes.add(note)
        self.sparse_calls += int(sparse)
        self.sage_calls += int(sage)
        self.routes[route] = self.routes.get(route, 0) + 1
        if total_tiles:
            self.skipped_tiles = (self.skipped_tiles or 0) + int(skipped_tiles or 0)
            self.total_tiles = (self.total_tiles or 0) + int(total_tiles)


class LayerStats:
    """One layer's step records, at most ``max_steps`` of them, for the current run."""

    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1; got {max_steps!r}.")
        self.max_steps = max_steps
        self.run: int | None = None
        self._steps: "OrderedDict[int, StepRecord]" = OrderedDict()

    def add(self, run: int | None, step: int, t: float | None, route: str, sparse: bool, sage: bool,
            skipped_tiles: int | None = None, total_tiles: int | None = None, note: str | None = None) -> None:
        """Count one call at ``step`` of ``run`` (a new run forgets the previous one)."""
        if run != self.run:
            self._steps.clear()
            self.run = run
        record = self._steps.get(step)
        if record is None:
            record = self._steps[step] = StepRecord(step, t)
            while len(self._steps) > self.max_steps:
                self._steps.popitem(last=False)
        elif record.t is None:
            record.t = t
        record.add(route, sparse, sage, skipped_tiles, total_tiles, note)

    @property
    def records(self) -> list[StepRecord]:
        return list(self._steps.values())

    def clear(self) -> None:
        self._steps.clear()

    def __len__(self) -> int:
        return len(self._steps)


def layer_step_rows(layers: Iterable[Any]) -> list[dict[str, Any]]:
    """One row per (layer, step): ``layer, role, step, t, route, sparse, skipped_fraction, sage, calls, note``.

    ``layers``: objects with ``label``, ``role`` and ``records`` (``LayerState``).
    """
    return [
        {"layer": layer.label, "role": layer.role, "step": r.step, "t": r.t, "route": r.route, "sparse": r.sparse,
         "skipped_fraction": r.skipped_fraction, "sage": r.sage, "calls": r.calls, "note": r.note}
        for layer in layers for r in layer.records
    ]


def step_table(layers: Iterable[Any]) -> list[dict[str, Any]]:
    """Per step over all ``layers``: t, dense or sparse, skipped-tile fraction, SAGE on/off, routes, calls,
    and what the policy dropped (per role)."""
    steps: dict[int, dict[str, Any]] = {}
    for layer in layers:
        for r in layer.records:
            row = steps.setdefault(r.step, {"t": r.t, "sparse_calls": 0, "calls": 0, "skipped": 0, "tiles": 0,
                                            "sage": False, "routes": set(), "notes": set()})
            if row["t"] is None:
                row["t"] = r.t
            row["calls"] += r.calls
            row["sparse_calls"] += r.sparse_calls
            row["sage"] |= r.sage
            row["routes"].update(r.routes)
            row["notes"].update(f"{layer.role}: {note}" for note in r.notes)
            if r.total_tiles:
                row["skipped"] += r.skipped_tiles or 0
                row["tiles"] += r.total_tiles
    return [
        {
            "step": step,
            "t": row["t"],
            "mode": "sparse" if row["sparse_calls"] else "dense",
            "sparse_calls": row["sparse_calls"],
            "calls": row["calls"],
            "skipped_fraction": row["skipped"] / row["tiles"] if row["tiles"] else None,
            "sage": row["sage"],
            "routes": ",".join(sorted(row["routes"])),
            "policy": "; ".join(sorted(row["notes"])),
        }
        for step, row in sorted(steps.items())
    ]


def format_step_table(rows: list[dict[str, Any]]) -> str:
    """``step_table`` rows as aligned text."""
    lines = [f"{'step':>4}  {'t':>6}  {'attention':<9}  {'skipped':>7}  {'SAGE':<4}  route"]
    for row in rows:
        t = "   n/a" if row["t"] is None else f"{row['t']:6.3f}"
        skipped = "    n/a" if row["skipped_fraction"] is None else f"{row['skipped_fraction']:7.1%}"
        policy = f"  ({row['policy']})" if row.get("policy") else ""
        lines.append(f"{row['step']:>4}  {t}  {row['mode']:<9}  {skipped}  {'on' if row['sage'] else 'off':<4}  {row['routes']}{policy}")
    return "\n".join(lines)
