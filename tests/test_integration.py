"""Install/uninstall, threads, copies and pickling, bounded statistics, per-token timesteps."""

from __future__ import annotations

import copy
import gc
import io
import logging
import pickle
import sys
import threading

import pytest
import torch

import tiny_models
from diffusers_trtllm import (TrtllmAttnProcessor, attach_denoise_tracking, detach_denoise_tracking, install,
                              uninstall)
from diffusers_trtllm.serving import intercept
from diffusers_trtllm.serving.layer import layer_of

SPARSE = dict(skip_softmax_threshold=0.3, backend="reference", quant={"dtype_qk": "int8", "k_block_size": 1})


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def _in_threads(*jobs, repeats: int = 30) -> list[list[torch.Tensor]]:
    """Run each job ``repeats`` times in its own thread, all at once; every output, per job."""
    outputs: list[list[torch.Tensor]] = [[] for _ in jobs]
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def worker(i, job):
        try:
            start.wait()
            for _ in range(repeats):
                outputs[i].append(job())
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return outputs


def _assert_all_equal(outputs, reference):
    wrong = sum(not torch.equal(out, reference) for out in outputs)
    assert wrong == 0, f"{wrong}/{len(outputs)} outputs differ from the single-thread run"


# ---- threads --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["flux", "sd3"])  # dispatch_attention_fn and F.scaled_dot_product_attention
def test_stock_model_beside_ours_is_never_routed(family):
    stock_model, inputs = tiny_models.build(family)
    ours, _ = tiny_models.build(family)
    stock_ref = _run(stock_model, inputs)
    install(ours, TrtllmAttnProcessor(**SPARSE))
    ours_ref = _run(ours, inputs)
    assert not torch.equal(ours_ref, stock_ref), "the sparse processor must change the output for this test to mean anything"
    stock_out, ours_out = _in_threads(lambda: _run(stock_model, inputs), lambda: _run(ours, inputs))
    _assert_all_equal(stock_out, stock_ref)
    _assert_all_equal(ours_out, ours_ref)


def test_two_models_sharing_one_processor_in_two_threads_keep_their_masks():
    proc = TrtllmAttnProcessor()
    runs = []
    for holes in ((2, 5), (6, 8)):
        model, inputs = tiny_models.build("qwenimage", batch=2)
        mask = torch.ones(2, 8, dtype=torch.bool)
        mask[0, holes[0]:holes[1]] = False
        inputs["encoder_hidden_states_mask"] = mask
        stock = _run(model, inputs)
        model.set_attn_processor(proc)
        single = _run(model, inputs)
        torch.testing.assert_close(single, stock, rtol=1e-5, atol=1e-5)
        runs.append((model, inputs, single))
    outputs = _in_threads(*[(lambda m=m, i=i: _run(m, i)) for m, i, _ in runs])
    for (_, _, single), outs in zip(runs, outputs):
        _assert_all_equal(outs, single)


def test_two_models_sharing_one_processor_in_two_threads_keep_their_timesteps():
    """One transformer at t=0.9 (gated: dense), the other at t=0.2 (sparse): each keeps its own t."""
    proc = TrtllmAttnProcessor(disabled_until_timestep=0.5, **SPARSE)
    runs = []
    for t in (0.9, 0.2):
        model, inputs = tiny_models.build("flux")
        inputs["timestep"] = torch.full_like(inputs["timestep"], t)
        install(model, proc)
        attach_denoise_tracking(model, timestep_divisor=1.0)
        runs.append((model, inputs, _run(model, inputs)))
    assert not torch.equal(runs[0][2], runs[1][2])
    outputs = _in_threads(*[(lambda m=m, i=i: _run(m, i)) for m, i, _ in runs])
    for (model, _, single), outs in zip(runs, outputs):
        _assert_all_equal(outs, single)
        sparse = {r.sparse for m in model.modules() if layer_of(m) is not None for r in layer_of(m).records}
        assert sparse == {model is runs[1][0]}


# ---- install / uninstall --------------------------------------------------------------------
def test_uninstall_restores_stock_bit_for_bit_and_every_global():
    from diffusers.models import attention_dispatch

    from diffusers_trtllm.serving import setters

    fresh, inputs = tiny_models.build("sd3")
    model, _ = tiny_models.build("sd3")
    flux, flux_inputs = tiny_models.build("flux")
    expected, flux_expected = _run(fresh, inputs), _run(flux, flux_inputs)
    proc = TrtllmAttnProcessor(**SPARSE)
    install(model, proc)
    flux.set_attn_processor(proc)
    assert intercept.rebound_modules()
    assert not torch.equal(_run(model, inputs), expected)
    uninstall(model)
    assert intercept.rebound_modules(), "flux still holds layers of ours: the globals stay rebound"
    uninstall(flux)
    assert torch.equal(_run(model, inputs), expected)
    assert torch.equal(_run(flux, flux_inputs), flux_expected)
    assert not any(layer_of(m) is not None for m in [*model.modules(), *flux.modules()])
    assert intercept.rebound_modules() == []
    module = sys.modules["diffusers.models.transformers.transformer_flux"]
    assert module.dispatch_attention_fn is attention_dispatch.dispatch_attention_fn
    assert sys.modules["diffusers.models.attention_processor"].F is torch.nn.functional
    assert not _setters_wrapped(), "the processor lives on, but nothing of ours is installed: Diffusers' setters are back"
    assert not setters._pending


def _setters_wrapped() -> bool:
    from diffusers.models.attention import AttentionMixin, AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    setters = (AttentionModuleMixin.set_processor, Attention.set_processor, AttentionMixin.set_attn_processor)
    wrapped = {hasattr(f, "__wrapped__") for f in setters}
    assert len(wrapped) == 1, "all three setters are wrapped together or not at all"
    return wrapped.pop()


@pytest.mark.parametrize("family", ["sd3", "flux"])  # an old-style Attention (stock not named) and a new one
def test_set_attn_processor_after_uninstall_binds_again(family):
    """The processor outlives uninstall; putting it back by Diffusers' own setter records the stock
    processor again (SD3's Attention names none), so the model is served, then restored bit for bit."""
    model, inputs = tiny_models.build(family)
    expected = _run(model, inputs)
    proc = TrtllmAttnProcessor(**SPARSE)
    install(model, proc)
    uninstall(model)
    model.set_attn_processor(proc)
    out = _run(model, inputs)
    assert {s.mode for s in proc.layers} != {None} and not torch.equal(out, expected)
    uninstall(model)
    assert torch.equal(_run(model, inputs), expected)


@pytest.mark.parametrize("family", ["sd3", "hunyuanvideo"])  # old-style Attention modules: no stock processor named
def test_set_attn_processor_after_the_stock_ones_were_set_back_binds_again(family):
    """Stock processors put back by ``set_attn_processor`` (the benchmark's way between settings), then ours by the
    same setter, once Diffusers' setters are its own again: the layers find the stock processors set back."""
    model, inputs = tiny_models.build(family)
    expected = _run(model, inputs)
    stock = dict(model.attn_processors)
    proc = TrtllmAttnProcessor(**SPARSE)
    model.set_attn_processor(proc)
    first = _run(model, inputs)
    model.set_attn_processor(dict(stock))
    assert torch.equal(_run(model, inputs), expected)
    model.set_attn_processor(proc)
    assert torch.equal(_run(model, inputs), first) and {s.mode for s in proc.layers} != {None}
    uninstall(model)
    assert torch.equal(_run(model, inputs), expected)


def test_a_processor_never_installed_leaves_diffusers_as_it_was():
    """Each live processor that has served no layer yet (a copy too) holds the setters' wrapping, for
    ``set_attn_processor(proc)``; the last one collected takes it away."""
    from diffusers_trtllm.serving import setters

    gc.collect()
    before = len(setters._pending)
    proc = TrtllmAttnProcessor()
    clone = copy.deepcopy(proc)
    assert len(setters._pending) == before + 2 and _setters_wrapped()
    del proc, clone
    gc.collect()
    assert len(setters._pending) == before
    if not before and not intercept.live_layers():
        assert not _setters_wrapped(), "with nothing of ours alive, Diffusers' own setters are back"


def test_install_on_a_pipeline_serves_both_wan22_experts():
    pipe, kwargs = tiny_models.wan_pipeline(two_experts=True)
    proc = TrtllmAttnProcessor()
    install(pipe, proc)
    assert len(proc.layers) == 8  # 2 blocks x (attn1, attn2) x 2 experts
    assert pipe.transformer._trtllm_tracker is pipe.transformer_2._trtllm_tracker
    assert torch.isfinite(pipe(**kwargs, num_inference_steps=2).frames).all()
    uninstall(pipe)
    assert not proc.layers


def test_install_on_a_module_without_set_attn_processor():
    """Latte-like: no AttentionMixin on the model; a plain container of attention modules."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    model = torch.nn.Sequential(Attention(query_dim=16, heads=2, dim_head=8, processor=AttnProcessor2_0())).eval()
    assert not hasattr(model, "set_attn_processor")
    x = torch.randn(2, 10, 16)
    with torch.no_grad():
        ref = model(x)
        proc = TrtllmAttnProcessor(backend="reference")
        install(model, proc)
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    assert [(s.name, s.role, s.mode) for s in proc.layers] == [("0", "self", "sdpa")]
    assert proc.layers[0].records[0].route == "reference"
    uninstall(model)
    assert torch.equal(model(x).detach(), ref)


def test_set_attention_backend_after_install_sets_the_stock_path():
    model, inputs = tiny_models.build("wan_t2v")
    proc = TrtllmAttnProcessor(roles={"cross": "stock"})
    install(model, proc)
    model.set_attention_backend("_native_math")
    stocks = [s.stock for s in proc.layers]
    assert all(str(getattr(s._attention_backend, "value", s._attention_backend)) == "_native_math" for s in stocks)
    _run(model, inputs)
    model.reset_attention_backend()


# ---- copies and pickling --------------------------------------------------------------------
def test_deepcopy_gives_an_independent_model():
    model, inputs = tiny_models.build("flux")
    install(model, TrtllmAttnProcessor())
    expected = _run(model, inputs)
    clone = copy.deepcopy(model)
    layers = [layer_of(m) for m in clone.modules() if layer_of(m) is not None]
    originals = [layer_of(m) for m in model.modules() if layer_of(m) is not None]
    assert layers and not {id(s) for s in layers} & {id(s) for s in originals}
    assert all(int(a.key) != int(b.key) for a, b in zip(layers, originals))
    del model, originals
    torch.testing.assert_close(_run(clone, inputs), expected)
    assert all(s.records for s in layers), "the copy is served by its own layers"
    sparse = TrtllmAttnProcessor(**SPARSE)
    install(clone, sparse)
    _run(clone, inputs)
    assert all(r.route == "reference" for s in sparse.layers for r in s.records)


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickle_round_trip(how):
    model, inputs = tiny_models.build("wan_t2v")
    proc = TrtllmAttnProcessor(**SPARSE)
    install(model, proc)
    expected = _run(model, inputs)
    if how == "pickle":
        restored = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        restored = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(_run(restored, inputs), expected)
    layers = [layer_of(m) for m in restored.modules() if layer_of(m) is not None]
    assert len(layers) == 4 and all(r.route == "reference" for s in layers for r in s.records[-1:])
    assert layers[0].processor.layers == sorted(layers, key=lambda s: int(s.key))


# ---- statistics and timesteps --------------------------------------------------------------
def test_statistics_stay_bounded_without_timestep_tracking():
    from diffusers_trtllm.stats import MAX_STEPS

    model, inputs = tiny_models.build("flux")
    proc = TrtllmAttnProcessor()
    install(model, proc)
    detach_denoise_tracking(model, by_user=False)  # untimed: every call a step of its own
    for state in proc.layers:
        state.stats.max_steps = 5
    for _ in range(12):
        _run(model, inputs)
    assert all(len(s.records) == 5 for s in proc.layers)
    assert [r.step for r in proc.layers[0].records] == list(range(7, 12))
    assert len(proc._layouts) <= 8 and MAX_STEPS >= 1000


def test_per_token_timestep_uses_the_largest_t():
    """Wan 2.2 TI2V: first-frame tokens at t=0, the rest at the step's t: gating follows the step's t."""
    model, inputs = tiny_models.build("wan_t2v")
    proc = TrtllmAttnProcessor(disabled_until_timestep=0.5, **SPARSE)
    install(model, proc)
    attach_denoise_tracking(model, timestep_divisor=1000.0)
    tokens = 2 * 4 * 4
    per_token = torch.full((1, tokens), 900.0)
    per_token[:, :16] = 0.0
    inputs["timestep"] = per_token
    _run(model, inputs)
    rows = proc.step_table()
    assert [(round(r["t"], 3), r["mode"]) for r in rows] == [(0.9, "dense")]


def test_detached_tracker_runs_dense_with_one_warning(caplog):
    model, inputs = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(disabled_until_timestep=0.9, **SPARSE)
    install(model, proc)
    attach_denoise_tracking(model, timestep_divisor=1.0)
    _run(model, inputs)
    assert all(r.sparse for s in proc.layers for r in s.records), "t=0.5 <= 0.9: sparse while tracked"
    detach_denoise_tracking(model)
    proc.reset_stats()
    with caplog.at_level(logging.WARNING, logger="diffusers_trtllm"):
        _run(model, inputs)
        _run(model, inputs)
    assert all(not r.sparse and r.t is None for s in proc.layers for r in s.records)
    assert sum("detached" in r.message for r in caplog.records) == 1


def test_a_second_processor_takes_the_layers_over():
    model, inputs = tiny_models.build("flux")
    first, second = TrtllmAttnProcessor(), TrtllmAttnProcessor(**SPARSE)
    install(model, first)
    _run(model, inputs)
    install(model, second)
    assert not first.layers and len(second.layers) == 2
    _run(model, inputs)
    assert all(r.route == "reference" for s in second.layers for r in s.records)
    uninstall(model)
    fresh, _ = tiny_models.build("flux")
    assert torch.equal(_run(model, inputs), _run(fresh, inputs)), "the recorded stock processors came back"
