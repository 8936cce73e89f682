"""The end-to-end benchmark on tiny versions of its model families (CPU), and its structured weights."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from diffusers_trtllm.bench.__main__ import main
from diffusers_trtllm.bench.e2e import SETTINGS, E2EOptions, _SkipStatistics, format_probe, probe, run_e2e
from diffusers_trtllm.bench.inputs import spy_sdpa
from diffusers_trtllm.bench.models import MODELS, build_model, model_inputs
from diffusers_trtllm.locality import local_attention
from diffusers_trtllm.measure import skipped_fraction

ROW_FIELDS = {"model", "weights", "config", "ms", "vs_stock", "rel_l1", "skipped", "skipped_route", "compiled", "routes",
              "policy", "threshold"}


@pytest.fixture
def one_thread():
    """Tiny forwards are dominated by thread hand-offs on a busy CI machine: one thread is faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_e2e_tiny_models_on_cpu(tmp_path, one_thread):
    configs = ["dense", "sage-int8", "skip", "sage-fp8+skip"]
    out = main(["e2e", "--tiny", "--device", "cpu", "--backend", "reference", "--configs", ",".join(configs),
                "--warmup", "0", "--iters", "1", "--out", str(tmp_path), "--name", "e2e", "--no-progress"])
    data = json.loads(out.read_text())
    env = data["environment"]
    assert env["torch"] == torch.__version__ and env["diffusers"] and "flashinfer" in env and "e2e" in env["command"]
    rows = data["rows"]
    assert len(rows) == len(MODELS) * 2 * (1 + len(configs))  # models x weights x (stock + settings)
    for row in rows:
        assert ROW_FIELDS <= set(row) and row["error"] is None, row
        assert row["ms"] > 0 and row["vs_stock"] > 0 and row["rel_l1"] is not None and row["compiled"] is False
    by_key = {(r["model"], r["weights"], r["config"]): r for r in rows}
    wan_skip = by_key[("wan2.1-t2v-14b", "structured", "skip")]
    assert wan_skip["threshold"] == 0.05 and wan_skip["skipped"] is not None
    assert wan_skip["routes"] == {"cross": "reference+skip", "self": "reference+skip"}
    assert by_key[("flux.1-dev", "random", "sage-int8")]["routes"]["joint"] == "reference+sage"
    stock = by_key[("flux.1-dev", "random", "stock")]
    assert stock["rel_l1"] == 0.0 and stock["routes"] == {} and stock["skipped"] is None
    assert wan_skip["policy"] == {}  # the policy's rules speak of GPU kernels only
    assert by_key[("wan2.1-t2v-1.3b", "random", "dense")]["rel_l1"] < 0.02
    for m in data["models"]:
        assert m["error"] is None and m["build_s"] > 0 and set(m["skip_curve"]) == {"random", "structured"}
        assert m["contrast"] == MODELS[m["model"]].contrast and m["threshold"]["structured"] == 0.05
    md = (tmp_path / "e2e.md").read_text()
    assert "| weights | config | compiled | ms | vs stock |" in md
    assert all(f"## {name}" in md for name in MODELS) and "| structured | sage-fp8+skip 0.05 | no |" in md


def test_e2e_compiled_rows_and_time_limit(tmp_path, one_thread):
    opts = E2EOptions(models=("flux.1-dev",), configs=("dense",), weights=("structured",), device="cpu",
                      backend="reference", warmup=0, iters=1, compile="full", compile_backend="eager", eager=False,
                      variant="tiny")
    models, rows = run_e2e(opts, show_progress=False)
    assert [(r.config, r.compiled, r.error) for r in rows] == [("stock", True, None), ("dense", True, None)]
    assert rows[1].routes and rows[1].vs_stock > 0
    assert "structured" not in models[0].skip_curve  # statistics come from the eager stock forward only
    seen = []
    models, rows = run_e2e(E2EOptions(device="cpu", variant="tiny", time_limit=0.0), show_progress=False,
                           on_item_done=lambda m, r: seen.append(len(m)))
    assert not rows and all(m.error == "not run: time limit reached" for m in models) and seen
    with pytest.raises(ValueError, match="unknown configs"):
        run_e2e(E2EOptions(configs=("sage-int4",), device="cpu"), show_progress=False)


def test_local_attention_makes_attention_skippable_and_restores_weights(one_thread):
    spec = MODELS["flux.1-dev"]
    model = build_model(spec, device="cpu", dtype=torch.float32, variant="tiny")
    inputs = model_inputs(spec, model, t=0.5, device="cpu", dtype=torch.float32, tiny=True, latent=(32, 32))
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def skipped(structured: bool) -> float:
        stats = _SkipStatistics(1, 8, 4)
        with torch.no_grad(), spy_sdpa(stats):
            if structured:
                with local_attention(model, 64.0) as changed:
                    assert changed == 2  # the double block's joint attention and the single block's
                    model(**inputs)
            else:
                model(**inputs)
        return skipped_fraction(stats.criticals(), 0.05)

    assert skipped(False) == 0.0 < skipped(True)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="contrast"):
        with local_attention(model, 0.0):
            pass


def test_probe_reports_a_curve_per_contrast(one_thread):
    data = probe(("wan2.1-t2v-1.3b",), (0.0, 32.0), device="cpu", dtype="float32", variant="tiny")
    by_contrast = data["wan2.1-t2v-1.3b"]
    assert set(by_contrast) == {"0", "32"} and set(by_contrast["0"]["curve"]) >= {"0.05", "0.001"}
    text = format_probe(data)
    assert "wan2.1-t2v-1.3b" in text and "threshold for 40%" in text


def test_settings_build_processor_arguments():
    assert SETTINGS["sage-fp8+skip"].processor_kwargs(0.02, "auto") == {
        "backend": "auto", "policy": "auto", "quant": {"dtype_qk": "fp8_e4m3"}, "skip_softmax_threshold": 0.02,
        "disabled_until_timestep": 0.0,
    }
    assert SETTINGS["dense"].processor_kwargs(0.02, "fa3") == {"backend": "fa3", "policy": "auto"}
    assert SETTINGS["sage-int8-nosmooth"].processor_kwargs(0.02, "auto")["quant"] == {"dtype_qk": "int8", "smooth_k": False}
    assert SETTINGS["sage-int8"].processor_kwargs(0.02, "auto")["quant"] == {"dtype_qk": "int8"}  # the route's block
    assert SETTINGS["sage-int8-k16"].processor_kwargs(0.02, "auto")["quant"] == {"dtype_qk": "int8", "k_block_size": 16}
    assert SETTINGS["skip-always"].processor_kwargs(0.02, "auto")["policy"] == "always"


def test_calibration_for_fits_the_reference_curve_at_the_target():
    from diffusers_trtllm.bench.e2e import calibration_for
    from diffusers_trtllm.bench.inputs import Shape, structured_qkv
    from diffusers_trtllm.measure import tile_criticals
    from diffusers_trtllm.calibration.checkpoint import parse_sparse_attention_config

    shape = Shape("s", 1, 2048, 2, 64, grid=(32, 64))
    q, k, _ = (x[0].float() for x in structured_qkv(shape, locality=1.0))
    crit = tile_criticals(q, k, 64**-0.5, 64, 64)
    config, lam = calibration_for(crit, 2048, 0.5)
    (group,) = parse_sparse_attention_config(config)
    assert group.target_sparsity == 0.5
    assert lam == pytest.approx(group.a * math.exp(group.b * 0.5) / 2048)
    assert abs(skipped_fraction(crit, lam) - 0.5) < 0.05  # the curve passes near the reference at the target
    assert calibration_for(torch.zeros_like(crit) + 2.0, 2048, 0.5) is None  # nothing skippable below lambda 1


def test_calibrated_row_loads_its_curve_or_says_why_not(tmp_path, one_thread, monkeypatch):
    """Tiny models have too few tiles to calibrate (the row says so); with a curve the row runs skip by target."""
    from diffusers_trtllm.bench import e2e
    from diffusers_trtllm.calibration.checkpoint import sparse_attention_config

    opts = E2EOptions(models=("wan2.1-t2v-14b",), configs=("skip-calibrated",), weights=("structured",), device="cpu",
                      backend="reference", warmup=0, iters=1, variant="tiny")
    _, rows = run_e2e(opts, show_progress=False)
    assert rows[1].error.startswith("not run: no threshold up to 1 skips 60%")
    curve = sparse_attention_config([("self_attention", 2.0, 1.0, None, None)], target_sparsity=0.5)
    monkeypatch.setattr(e2e, "calibration_for", lambda crit, kv_len, target: (curve, 0.25))
    _, rows = run_e2e(opts, show_progress=False)
    row = rows[1]
    assert row.error is None and row.threshold == 0.25 and row.routes["self"] == "reference+skip"
    assert SETTINGS["skip-calibrated"].processor_kwargs(0.05, "auto") == {
        "backend": "auto", "policy": "auto", "target_sparsity": 0.5, "disabled_until_timestep": 0.0}


def test_alternating_rounds_time_each_setting_beside_stock(tmp_path, one_thread, monkeypatch):
    """``--alternate N``: every timed setting gets N stock/setting ratios, timed back to back with the setting
    installed as it ran (a calibrated one with its curve and threshold), and ``vs_stock`` is their median; a row
    that did not run gets none."""
    from diffusers_trtllm.bench import e2e
    from diffusers_trtllm.calibration.checkpoint import sparse_attention_config

    curve = sparse_attention_config([("self_attention", 2.0, 1.0, None, None)], target_sparsity=0.5)
    monkeypatch.setattr(e2e, "calibration_for", lambda crit, kv_len, target: (curve, 0.25))
    installs = []
    install = e2e._ModelBench.install
    monkeypatch.setattr(e2e._ModelBench, "install", lambda self, setting, threshold, collect_stats=False,
                        calibration=None: installs.append((setting.name, threshold, calibration is not None))
                        or install(self, setting, threshold, collect_stats, calibration))
    opts = E2EOptions(models=("wan2.1-t2v-14b",), configs=("dense", "skip-calibrated"), weights=("structured",),
                      device="cpu", backend="reference", warmup=0, iters=1, variant="tiny", alternate=2)
    _, rows = run_e2e(opts, show_progress=False)
    by_config = {r.config: r for r in rows}
    for name in ("dense", "skip-calibrated"):
        row = by_config[name]
        assert row.error is None and len(row.vs_stock_rounds) == 2
        assert row.vs_stock == statistics.median(row.vs_stock_rounds)
    assert by_config["stock"].vs_stock_rounds == []
    assert [(name, calibrated) for name, _, calibrated in installs[-4:]] == [("stock", False), ("skip-calibrated", True)] * 2
    assert installs[-1][1] == 0.25  # the calibrated row's own threshold
    from diffusers_trtllm.bench.report import environment, write_e2e_markdown

    write_e2e_markdown(tmp_path / "e2e.md", environment("cpu", ["e2e"]), opts, [], rows)
    assert "the median over 2 rounds" in (tmp_path / "e2e.md").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_e2e_probe_models_on_gpu():
    """One block, two heads, full geometry: every setting runs, and structured weights skip tiles."""
    opts = E2EOptions(models=("wan2.1-t2v-1.3b", "flux.1-dev"), variant="probe", warmup=0, iters=2, device="cuda")
    _, rows = run_e2e(opts, show_progress=False)
    # Random weights attend flatly: no curve to calibrate, and the row says so.
    flat = [r for r in rows if r.weights == "random" and r.config == "skip-calibrated"]
    assert flat and all(r.error.startswith("not run: no threshold up to 1") for r in flat)
    rows = [r for r in rows if r not in flat]
    assert all(r.error is None for r in rows), [(r.model, r.config, r.error) for r in rows if r.error]
    for r in rows:
        if r.config == "dense":
            assert r.rel_l1 < 0.02
        if r.weights == "structured" and "skip" in r.config:
            ran = any("+skip" in route for role, route in r.routes.items() if role != "cross")
            # skip-softmax either ran on self/joint attention and skipped, or the policy says why it did not
            assert (r.skipped > 0.2) if ran else any("skip-softmax off" in n for n in r.policy.values()), r
            if r.config == "skip-always" or (r.config == "skip-calibrated" and r.model.startswith("wan")):
                assert ran, r  # (Flux's 4,608 keys are too few for skip alone: the policy says so)
            if r.config == "skip-calibrated" and ran:
                assert abs(r.skipped - 0.5) < 0.1, r
        if r.model.startswith("wan") and "skip" in r.config:
            assert "+skip" not in r.routes["cross"] or r.config == "skip-always", r  # 512 text keys: skip cannot pay
            assert "+skip" in r.routes["cross"] or "cross" in r.policy, r


def test_route_skipped_fraction_needs_every_skip_call_counted():
    """The summary's skipped fraction covers every skip-softmax call, or is left out: a count over the
    cross-attention alone (its route counts, self-attention's fmha-v2 does not) would pass for the whole."""
    from types import SimpleNamespace

    from diffusers_trtllm.bench.e2e import processor_summary

    def record(route, sparse, skipped=None, total=None):
        return SimpleNamespace(route=route, sparse=sparse, sage=False, skipped_tiles=skipped, total_tiles=total, note=None)

    def proc(*layers):
        return SimpleNamespace(layers=[SimpleNamespace(role=role, records=recs) for role, recs in layers])

    counted = proc(("cross", [record("triton", True, 0, 40)]), ("self", [record("triton", True, 30, 60)]))
    assert processor_summary(counted).skipped_route == pytest.approx(0.3)
    partial = proc(("cross", [record("triton", True, 0, 40)]), ("self", [record("fmha-v2", True)]))
    summary = processor_summary(partial)
    assert summary.skipped_route is None and summary.routes == {"cross": "triton+skip", "self": "fmha-v2+skip"}
    dense_self = proc(("cross", [record("triton", True, 1, 4)]), ("self", [record("fa3", False)]))
    assert processor_summary(dense_self).skipped_route == 0.25


def test_cp_bench_refuses_calibrated_settings_with_the_reason(capsys):
    from diffusers_trtllm.bench import cp

    with pytest.raises(SystemExit):
        cp.parse_args(["--configs", "dense,skip-calibrated"])
    assert "fit their curve to the e2e bench's stock forward" in capsys.readouterr().err
    assert cp.parse_args(["--configs", "skip-always"]).configs == ("skip-always",)


def test_skip_statistics_leave_out_text_only_self_attention():
    """HunyuanVideo's text refiner attends over its text alone before the joint calls: its tiles are not the
    video's (and of another shape), so the statistics keep only calls of more tokens than the text."""
    stats = _SkipStatistics(1, 8, 2, text_tokens=256)
    g = torch.Generator().manual_seed(0)
    for tokens in (256, 700, 256, 700):
        x = torch.randn(1, 2, tokens, 16, generator=g)
        stats(0, x, x, x)
    assert len(stats.crits) == 2 and stats.criticals().shape[0] == 4  # 2 calls of the 700 tokens x 2 heads
