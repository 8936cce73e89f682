"""Per-layer, per-step statistics of served attention calls, bounded in memory.

Each layer keeps one :class:`StepRecord` per denoising step (calls of that step are
added into it), in a :class:`LayerStats` that holds at most ``max_steps`` steps and
drops the oldest first. So memory stays bounded whether or not a timestep is tracked
(without one, a layer's n-th call is its step n). A new run (a timestep tracker
seeing ``t`` rise) starts the layer's statistics afresh.

The data is plain: :func:`layer_step_rows` gives one dict per (layer, step) with the
columns ``layer, role, step, t, route, sparse, skipped_fraction, sage, calls, note``;
:func:`step_table` sums them per step for :func:`format_step_table`. See docs/design.md.

For people reading them: :func:`summary` adds to each (layer, step) row what ran in words
(``sparse``, ``dense``, ``dense (gated)`` when ``t`` was above ``disabled_until_timestep``,
``stock``), the SAGE dtype that actually ran (``int8``, ``fp8_e4m3`` or ``off``, so a gated
step with SAGE on is never read as full precision) and where each setting came from
(``user``, ``checkpoint ...``, ``default``); :func:`plot` draws the skipped fraction as a
heatmap. They read layers only through ``layer_step_rows`` and each layer's settings.

Under context parallelism every process records its own calls: the tables of a rank cover
its heads (Ulysses) and its queries against every KV shard, one call per shard (ring), and
the text tables say so on their first line (:func:`rank_lines`).
"""

from __future__ import annotations

import os

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["StepRecord", "LayerStats", "layer_step_rows", "step_table", "format_step_table", "MAX_STEPS",
           "summary", "format_summary", "plot", "setting_sources"]

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
    #: What the policy dropped from the request on these calls, and why (``routing.policy.apply_policy``).
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

    def add(self, run: int | None, step: int | None, t: float | None, route: str, sparse: bool, sage: bool,
            skipped_tiles: int | None = None, total_tiles: int | None = None, note: str | None = None) -> None:
        """Count one call at ``step`` of ``run`` (a new run forgets the previous one); ``step`` None (no timestep
        known): the call is the next step of the run."""
        if run != self.run:
            self._steps.clear()
            self.run = run
        if step is None:
            step = next(reversed(self._steps)) + 1 if self._steps else 0
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
            row = steps.setdefault(r.step, {"t": r.t, "sparse_calls": 0, "gated_calls": 0, "calls": 0, "skipped": 0,
                                            "tiles": 0, "sage": False, "sage_dtypes": set(), "routes": set(),
                                            "notes": set()})
            if row["t"] is None:
                row["t"] = r.t
            row["calls"] += r.calls
            row["sparse_calls"] += r.sparse_calls
            row["gated_calls"] += r.calls if _attention(layer, r) == "dense (gated)" else 0
            row["sage"] |= r.sage
            row["sage_dtypes"].add(_sage_dtype(layer, r))
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
            "gated": bool(row["gated_calls"]) and not row["sparse_calls"],  # dense because of the timestep
            "sparse_calls": row["sparse_calls"],
            "calls": row["calls"],
            "skipped_fraction": row["skipped"] / row["tiles"] if row["tiles"] else None,
            "sage": row["sage"],
            "sage_dtype": "/".join(sorted(row["sage_dtypes"])),  # what ran: int8, fp8_e4m3, off
            "routes": ",".join(sorted(row["routes"])),
            "policy": "; ".join(sorted(row["notes"])),
        }
        for step, row in sorted(steps.items())
    ]


def rank_lines() -> list[str]:
    """A line saying which process's statistics these are, under ``torch.distributed`` with more than
    one process; no line otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return []
    return [f"statistics of rank {dist.get_rank()} of {dist.get_world_size()} only (its heads under Ulysses; "
            "under ring its queries, one call per KV shard)"]


def format_step_table(rows: list[dict[str, Any]], layers: Iterable[Any] | None = None) -> str:
    """``step_table`` rows as aligned text; with ``layers``, a first line says where the settings came from.
    Under several processes a line first says the table is this rank's."""
    if not rows:
        return "\n".join(rank_lines() + ["nothing ran yet: no attention call has reached this processor "
                                          "(install(pipe, proc), then run the pipeline)."])
    lines = rank_lines() + ([_sources_line(layers)] if layers is not None else [])
    sages = [row.get("sage_dtype") or ("on" if row["sage"] else "off") for row in rows]
    width = max(map(len, sages + ["SAGE"]))
    lines.append(f"{'step':>4}  {'t':>6}  {'attention':<13}  {'skipped':>7}  {'SAGE':<{width}}  route")
    for row, sage in zip(rows, sages):
        t = "   n/a" if row["t"] is None else f"{row['t']:6.3f}"
        skipped = "    n/a" if row["skipped_fraction"] is None else f"{row['skipped_fraction']:7.1%}"
        mode = "dense (gated)" if row.get("gated") else row["mode"]
        policy = f"  ({row['policy']})" if row.get("policy") else ""
        lines.append(f"{row['step']:>4}  {t}  {mode:<13}  {skipped}  {sage:<{width}}  {row['routes']}{policy}")
    return "\n".join(lines)


def _attention(state: Any, record: Any) -> str:
    """What a (layer, step) record ran, in words."""
    if record.sparse:
        return "sparse"
    if record.route == "stock":
        return "stock"
    settings = state.settings()
    skip = settings.skip if settings.mode == "trtllm" else None
    if skip is not None and skip.configured and not skip.active_at(record.t):
        return "dense (gated)"
    return "dense"


def _sage_dtype(state: Any, record: Any) -> str:
    """The SAGE dtype that ran, or ``off``."""
    quant = state.settings().quant
    return quant.dtype_qk if record.sage and quant is not None else "off"


def setting_sources(state: Any) -> dict[str, str]:
    """Where each of a layer's settings came from: ``user``, ``user (roles)``, ``checkpoint ...`` or ``default``."""
    proc = state.processor
    role_override = proc.roles.get(state.role) if isinstance(proc.roles, dict) else None
    explicit = proc._explicit_settings(state.role)

    def by_user(key: str) -> str:
        if isinstance(role_override, str):
            return f"user (roles[{state.role!r}]={role_override!r})"
        if isinstance(role_override, dict) and key in role_override:
            return "user (roles)"
        return "user" if key in explicit else "default"

    cal = state.calibration
    checkpoint = f"checkpoint {cal.source}".strip() if cal is not None else "checkpoint"
    settings = state.settings()
    skip = settings.skip
    if state.ignored:
        skip_source = f"{checkpoint} (ignore: stays dense)"
    elif not skip.configured:
        skip_source = by_user("skip_softmax_threshold")
    elif skip.threshold is not None:
        skip_source = by_user("skip_softmax_threshold")
    else:
        user = by_user("target_sparsity")
        skip_source = (user if user != "default" else checkpoint) + (f", curve from {checkpoint}" if cal else "")
    gate = by_user("disabled_until_timestep")
    if gate == "default" and cal is not None and cal.disabled_until_timestep and skip.target_sparsity is not None:
        gate = checkpoint
    return {"skip_source": skip_source, "gate_source": gate, "quant_source": by_user("quant"),
            "route_source": by_user("backend")}


def _sources_line(layers: Iterable[Any]) -> str:
    found: dict[str, set[str]] = {}
    for state in layers:
        for key, value in setting_sources(state).items():
            found.setdefault(key.replace("_source", ""), set()).add(value)
    return "settings from: " + "; ".join(f"{key} {' | '.join(sorted(v))}" for key, v in found.items())


def summary(layers: Iterable[Any]) -> list[dict[str, Any]]:
    """``layer_step_rows`` with, per row, what ran in words, the SAGE dtype that ran and the settings' sources.

    Extra columns: ``attention`` (``sparse``, ``dense``, ``dense (gated)``, ``stock``), ``sage_dtype``,
    ``threshold``, ``target_sparsity``, ``disabled_until_timestep`` and ``skip_source``, ``gate_source``,
    ``quant_source``, ``route_source``. ``pandas.DataFrame(summary(proc.layers))`` makes it a table.
    """
    layers = list(layers)
    rows = []
    for layer in layers:
        records = layer.records
        if not records:
            continue
        sources = setting_sources(layer)
        skip = layer.settings().skip
        settings = {"threshold": skip.threshold, "target_sparsity": skip.target_sparsity,
                    "disabled_until_timestep": skip.disabled_until_timestep if skip.configured else None}
        for row, record in zip(layer_step_rows([layer]), records):
            rows.append({**row, "attention": _attention(layer, record), "sage_dtype": _sage_dtype(layer, record),
                         **settings, **sources})
    return rows


def format_summary(layers: Iterable[Any]) -> str:
    """Per layer: the skipped fraction at each step (``-``: nothing skipped or measured)."""
    rows = summary(layers)
    steps = sorted({r["step"] for r in rows})
    names = list(dict.fromkeys(f"{r['layer']} ({r['role']})" for r in rows))
    width = max([len(n) for n in names] + [5])
    cell = {(f"{r['layer']} ({r['role']})", r["step"]): r["skipped_fraction"] for r in rows}
    lines = rank_lines()
    lines.append(f"{'layer':<{width}}  " + " ".join(f"{s:>5}" for s in steps))
    for name in names:
        values = [cell.get((name, s)) for s in steps]
        lines.append(f"{name:<{width}}  " + " ".join(f"{v:5.0%}" if v else "    -" for v in values))
    return "\n".join(lines)


def plot(layers: Iterable[Any], path: str | os.PathLike, title: str | None = None) -> str:
    """A heatmap of the skipped-tile fraction, layers by steps, saved to ``path`` (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "proc.plot() draws with matplotlib, which is not installed; pip install matplotlib "
            "(or use proc.summary() for the numbers)."
        ) from err
    import numpy as np

    rows = summary(layers)
    if not rows:
        raise ValueError("nothing to plot: the processor has recorded no attention call yet; run the pipeline first.")
    steps = sorted({r["step"] for r in rows})
    names = list(dict.fromkeys(f"{r['layer']} ({r['role']})" for r in rows))
    grid = np.full((len(names), len(steps)), np.nan)
    t_of: dict[int, float | None] = {}
    for r in rows:
        t_of.setdefault(r["step"], r["t"])
        if r["skipped_fraction"] is not None:
            grid[names.index(f"{r['layer']} ({r['role']})"), steps.index(r["step"])] = r["skipped_fraction"]
    fig, ax = plt.subplots(figsize=(4.0 + 0.45 * len(steps), 1.2 + 0.3 * len(names)), dpi=100)
    top = float(np.nanmax(grid)) if np.isfinite(grid).any() else 1.0
    image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=max(0.01, top))
    ax.set_xticks(range(len(steps)), [f"{s}\n{t_of[s]:.2f}" if t_of[s] is not None else str(s) for s in steps], fontsize=7)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("step / t")
    ax.set_title(title or "skipped-tile fraction (blank: not measured)", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.05)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return os.fspath(path)
