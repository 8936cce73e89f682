"""``benchmarks/skip_coupling.py``'s model of a CTA's two consumers (benchmarks/results/LOG.md cites its table)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

_SPEC = importlib.util.spec_from_file_location(
    "skip_coupling", Path(__file__).resolve().parents[1] / "benchmarks" / "skip_coupling.py")
skip_coupling = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(skip_coupling)


def test_nothing_skipped_costs_one_tile_a_tile_and_all_skipped_the_skip_cost():
    none = np.zeros((3, 9), dtype=bool)
    for lead in skip_coupling.LEADS.values():
        assert skip_coupling.cta_time(none, none, 0.5, *lead) == 1.0
        assert np.isclose(skip_coupling.cta_time(~none, ~none, 0.5, *lead), (1 + 9 * 0.5) / 10)


def test_a_consumer_that_skips_waits_for_the_other_under_the_ping_pong():
    a = np.ones((1, 9), dtype=bool)  # every tile after the first skipped by one consumer, none by the other
    b = np.zeros((1, 9), dtype=bool)
    times = {name: skip_coupling.cta_time(a, b, 0.5, *lead) for name, lead in skip_coupling.LEADS.items()}
    assert times["ping-pong"] == times["free"] == 1.0  # the CTA takes as long as its slower consumer


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 1.0))
def test_a_longer_lead_is_never_slower_and_an_unbounded_one_is_the_slower_consumer(seed, cost):
    rng = np.random.default_rng(seed)
    a, b = rng.random((2, 4, 12)) < rng.random()
    ping_pong, stages, free = (skip_coupling.cta_time(a, b, cost, *lead) for lead in skip_coupling.LEADS.values())
    assert ping_pong + 1e-12 >= stages >= free - 1e-12
    own = [1 + np.where(x, cost, 1.0).sum(-1) for x in (a, b)]  # each consumer's time alone, per CTA
    assert np.isclose(free, np.maximum(*own).mean() / 13)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 700), st.sampled_from([8, 16, 32, 64]))
def test_dealt_rows_are_a_permutation_that_gives_each_half_its_turns(tokens, group):
    rows = skip_coupling.dealt_rows(tokens, group)
    assert sorted(rows.tolist()) == list(range(tokens))
    whole = tokens // 128 * 128
    assert rows[whole:].tolist() == list(range(whole, tokens))  # the last partial block stays in place
    for start in range(0, whole, 128):
        first_half = rows[start : start + 64] - start  # the first warpgroup's rows of this block
        assert all((r // group) % 2 == 0 for r in first_half.tolist())
    if group == 64:
        assert rows.tolist() == list(range(tokens))  # the kernel's contiguous halves
