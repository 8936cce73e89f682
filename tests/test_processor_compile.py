"""torch.compile sees the processor's attention call as one opaque op: no graph break."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor, attach_denoise_tracking, install


@pytest.mark.parametrize("family", ["flux", "wan_t2v", "sd3", "qwenimage", "hunyuanvideo"])
def test_no_graph_break(family):
    model, inputs = tiny_models.build(family)
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.3, disabled_until_timestep=0.9, backend="reference")
    model.set_attn_processor(proc)
    attach_denoise_tracking(model, proc, timestep_divisor=1.0 if family == "flux" else 1000.0)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(**inputs)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("diffusers_trtllm.attention" in op for op in ops) == len(proc.layers)


def test_compiled_transformer_matches_eager():
    model, inputs = tiny_models.build("flux")
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.3, disabled_until_timestep=0.6, backend="reference")
    model.set_attn_processor(proc)
    attach_denoise_tracking(model, proc, timestep_divisor=1.0)
    with torch.no_grad():
        eager = model(**inputs)[0]
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        noisy = dict(inputs, timestep=torch.full_like(inputs["timestep"], 0.95))  # gated: dense, same graph
        compiled(**noisy)
        out = compiled(**inputs)[0]
    torch.testing.assert_close(out, eager)
    assert [(round(r["t"], 3), r["mode"]) for r in proc.step_table()] == [(0.95, "dense"), (0.5, "sparse")]


@pytest.mark.parametrize("family,block_classes", [("flux", 2), ("wan_t2v", 1)])
def test_regional_compile_one_graph_per_block_class(family, block_classes):
    """``compile_repeated_blocks(fullgraph=True)``: no graph break, no recompile per layer or per step."""
    from torch._dynamo.utils import counters

    model, inputs = tiny_models.build(family)
    proc = TrtllmAttnProcessor(skip_softmax_threshold=0.3, disabled_until_timestep=0.6, backend="reference")
    install(model, proc)
    divisor = 1.0 if family == "flux" else 1000.0
    attach_denoise_tracking(model, timestep_divisor=divisor)
    torch._dynamo.reset()
    counters.clear()
    at = [dict(inputs, timestep=torch.full_like(inputs["timestep"], t * divisor)) for t in (0.9, 0.5, 0.1)]
    with torch.no_grad():
        eager = model(**at[-1])[0]
        model.compile_repeated_blocks(fullgraph=True, backend="eager")
        for step_inputs in at:  # across the gate: dense, then sparse
            out = model(**step_inputs)[0]
    torch.testing.assert_close(out, eager)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == block_classes, dict(counters["stats"])
    assert [r["mode"] for r in proc.step_table()] == ["dense", "sparse", "sparse"]


def test_cuda_graph_capture_is_refused_in_one_line(monkeypatch):
    """Inside a CUDA graph capture (``mode="reduce-overhead"``) the op refuses, naming the compile modes that work,
    before it looks up its layer."""
    from diffusers_trtllm.serving import intercept

    monkeypatch.setattr(intercept, "_capturing", lambda device: True)
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"cannot run inside a CUDA graph .*max-autotune-no-cudagraphs"):
        torch.ops.diffusers_trtllm.attention(q, q, q, None, None, None, torch.tensor(-1), None, 4, -1, False)


def test_capture_is_looked_for_on_the_querys_gpu(monkeypatch):
    """torch says whether the current device's stream captures: a query on another GPU is asked about on its own
    (a capture there was not refused); CPU tensors are never captured."""
    from diffusers_trtllm.serving import intercept

    entered = []

    class _Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append(None)

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", _Device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: bool(entered) and entered[-1] is not None)
    assert not intercept._capturing(torch.device("cpu"))
    assert not intercept._capturing(torch.device("cuda", 0)) and not entered
    assert intercept._capturing(torch.device("cuda", 1))
    assert entered == [torch.device("cuda", 1), None]


def test_regional_compile_binds_a_reinstalled_processor_once(monkeypatch):
    """A processor put back on a model (its layers bound again at the first forward, Diffusers' setters no longer
    wrapped once no layer of ours was left) under compile_repeated_blocks: the compiled blocks see the binding and
    do not bind again every forward (they did, recompiling up to Dynamo's limit: Flux.1-dev on an H100, issue 57)."""
    from diffusers_trtllm.serving.processor import TrtllmAttnProcessor as Proc

    model, inputs = tiny_models.build("flux")
    stock = dict(model.attn_processors)
    proc = TrtllmAttnProcessor(backend="reference")
    binds = []
    bind = Proc._bind
    monkeypatch.setattr(Proc, "_bind",
                        lambda self, module, *a, **k: binds.append(module) or bind(self, module, *a, **k))
    torch._dynamo.reset()
    with torch.no_grad():
        model.set_attn_processor(proc)
        eager = model(**inputs)[0]
        model.set_attn_processor(dict(stock))
        model.compile_repeated_blocks(backend="eager")
        model(**inputs)
        model.set_attn_processor(proc)
        binds.clear()
        outs = [model(**inputs)[0] for _ in range(3)]
    assert len(binds) <= len(stock), len(binds)  # once per attention module at most, at the first forward
    for out in outs:
        torch.testing.assert_close(out, eager)
