"""CPU smoke test of the benchmark harness, and checks of its inputs and skip statistics."""

from __future__ import annotations

import json

import pytest
import torch

from diffusers_trtllm.bench import SHAPES, capture_qkv, load_qkv, save_qkv, structured_qkv
from diffusers_trtllm.bench.__main__ import main
from diffusers_trtllm.bench.inputs import Shape, parse_shapes
from diffusers_trtllm.measure import skipped_fraction, threshold_for, tile_criticals
from diffusers_trtllm.kernels.reference import reference_attention
from diffusers_trtllm.layout import PackedLayout


def test_harness_runs_on_cpu(tmp_path):
    out = main(
        ["--shapes", "tiny", "--device", "cpu", "--routes", "sdpa,reference,auto", "--thresholds", "0.01",
         "--target-skips", "0.25", "--locality", "0.8", "--out", str(tmp_path), "--warmup", "1", "--iters", "2", "--no-progress"]
    )
    data = json.loads(out.read_text())
    assert data["environment"]["torch"] == torch.__version__ and "command" in data["environment"]
    (shape,) = data["shapes"]
    rows = {(r["impl"], r["config"]): r for r in shape["rows"]}
    baselines = [rows[("torch-sdpa", "dense")], rows[("torch-sdpa (again)", "dense")]]
    assert max(r["vs_baseline"] for r in baselines) == 1.0  # the faster of the two baseline timings
    assert rows[("sdpa", "dense")]["rel_l1"] < 1e-2 and rows[("sdpa", "dense")]["cosine"] > 0.9999
    assert rows[("auto (sdpa)", "dense")]["ms"] > 0
    skip_rows = [r for r in shape["rows"] if r["impl"] == "reference" and r["config"].startswith("skip")]
    assert len(skip_rows) == 2 and all(r["skipped_ref"] is not None and r["ideal_speedup"] >= 1 for r in skip_rows)
    target = next(r for r in skip_rows if r["target_skip"] == 0.25)
    assert target["skipped_ref"] >= 0.25
    assert any(r["config"] == "sage int8" and r["ref_rel_l1"] < 0.1 for r in shape["rows"])
    # SAGE and skip-softmax together, at every threshold, on the routes that serve both.
    both = [r for r in shape["rows"] if r["impl"] == "reference" and r["quant"] and r["threshold"] is not None]
    assert {(r["quant"], r["target_skip"]) for r in both} == {(q, t) for q in ("int8", "fp8_e4m3") for t in (None, 0.25)}
    assert all(r["config"].startswith(f"sage {r['quant']} + skip") and r["skipped_ref"] is not None for r in both)
    assert not any(r["impl"].startswith("auto") and r["quant"] for r in shape["rows"])
    assert shape["not_run"]["sdpa skip"] == "no skip-softmax"  # a route that cannot serve a config says why
    md = (tmp_path / "bench.md").read_text()
    assert "| torch-sdpa | dense |" in md and "Not run" in md


def test_tile_criticals_match_the_reference_skip_count():
    shape = Shape("t", 1, 700, 2, 32, (25, 28))
    q, k, v = structured_qkv(shape, 0.6, dtype=torch.float32)
    layout = PackedLayout.dense(1, 700, 700, "cpu")
    crit = tile_criticals(q[0], k[0], 32**-0.5, 64, 128)
    for lam in (1e-3, 1e-2, 0.1):
        ref = reference_attention(
            q[0], k[0], v[0], layout.cu_seqlens_q, layout.cu_seqlens_kv, layout.q_lens, layout.kv_lens,
            softmax_scale=32**-0.5, skip_factor=lam * 700, tile_q=64, tile_kv=128,
        )
        assert skipped_fraction(crit, lam) == pytest.approx(ref.skipped_fraction)
    lam = threshold_for(crit, 0.3)
    assert lam is not None and skipped_fraction(crit, lam) >= 0.3
    assert threshold_for(crit, 0.999) is None  # would need lambda > 1


def test_locality_knob():
    shape = SHAPES["tiny"]
    q0, k0, _ = structured_qkv(shape, 0.0, dtype=torch.float32)
    q1, k1, _ = structured_qkv(shape, 0.8, dtype=torch.float32)
    assert torch.equal(structured_qkv(shape, 0.8, dtype=torch.float32)[0], q1)  # seeded
    flat = tile_criticals(q0[0], k0[0], 64**-0.5, 64, 64)
    local = tile_criticals(q1[0], k1[0], 64**-0.5, 64, 64)
    assert skipped_fraction(flat, 0.01) == 0.0 < skipped_fraction(local, 0.01)
    with pytest.raises(ValueError, match="locality"):
        structured_qkv(shape, 1.5)


def test_reach_spread_gives_heads_different_reach():
    """Issue 34's inputs: with ``reach_spread`` the heads' skippable fractions spread apart, the last head (which
    attends farthest) skipping the fewest tiles; without it they are alike; the default stays the inputs they were."""
    shape = Shape("reach", 1, 1024, 4, 64, (32, 32))

    def per_head(spread):
        q, k, _ = structured_qkv(shape, 0.6, dtype=torch.float32, reach_spread=spread)
        crit = tile_criticals(q[0], k[0], 64**-0.5, 64, 64)
        return [skipped_fraction(crit[h:h + 1], 0.01) for h in range(shape.heads)]

    spread, alike = per_head(1.5), per_head(0.0)
    assert spread[-1] == min(spread) and max(spread) - min(spread) > 0.15, spread
    assert max(alike) - min(alike) < 0.05, alike
    assert torch.equal(structured_qkv(shape, 0.6)[0], structured_qkv(shape, 0.6, reach_spread=0.0)[0])


def test_save_load_and_capture(tmp_path):
    q, k, v = structured_qkv(SHAPES["tiny"], 0.5)
    save_qkv(tmp_path / "a.pt", q, k, v, name="x", layer=3)
    q2, _, _, meta = load_qkv(tmp_path / "a.pt")
    assert torch.equal(q, q2) and meta == {"name": "x", "layer": 3}
    with capture_qkv(tmp_path / "b.pt", call_index=1, name="spy") as state:
        for _ in range(2):
            torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    assert state["saved"]
    qc, kc, _, meta = load_qkv(tmp_path / "b.pt")
    assert torch.equal(qc, q) and meta["call_index"] == 1 and meta["name"] == "spy"
    with pytest.raises(ValueError, match="batch, tokens"):
        save_qkv(tmp_path / "c.pt", q[0], k, v)


def test_parse_shapes():
    assert [s.name for s in parse_shapes("standard")][:2] == ["flux_1024", "qwen_image_1328"]
    (custom,) = parse_shapes("mine=2:100:4:64")
    assert (custom.batch, custom.tokens, custom.heads, custom.head_dim) == (2, 100, 4, 64)
    with pytest.raises(ValueError, match="unknown shape"):
        parse_shapes("nope")


def test_environment_names_flashinfer_by_its_distribution(monkeypatch):
    import importlib.metadata

    from diffusers_trtllm.bench import report

    real = importlib.metadata.version

    def version(name):
        if name == "flashinfer-python":
            return "0.7.4"
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    env = report.environment("cpu")
    assert env["flashinfer"] == "0.7.4" and env["diffusers"]
