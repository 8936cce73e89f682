"""Why a self-attention call inside the end-to-end forward takes the ``sage-sm90`` kernel longer than the benchmark's.

    python3 benchmarks/e2e_attention_probe.py --model wan2.1-t2v-14b --call 0

Records the Q, K, V of one self-attention call of the end-to-end benchmark's model (structured weights, as
``bench e2e --weights structured`` builds it) and times, on them and on the attention benchmark's inputs of the
same shape (``structured_qkv``, reach spread 0 and 1): cuDNN SDPA, the whole ``sage-sm90`` call, the kernel
alone, and the kernel with skip-softmax at ``--threshold``. Beside the times, what the kernel's data-dependent
branches see on each input: the share of (16-row warp, 128-key tile) pairs where some row's running max moves
(O is rescaled there) and where the fast exponent's condition fails (``k_scale * q_scale'`` at or above 2^-8:
the exact path).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusers_trtllm.bench.e2e import _Enough  # noqa: E402
from diffusers_trtllm.bench.external import BASELINE_CUDA, external_impls  # noqa: E402
from diffusers_trtllm.bench.inputs import SHAPES, spy_sdpa, structured_qkv  # noqa: E402
from diffusers_trtllm.bench.models import MODELS, build_model, model_inputs  # noqa: E402
from diffusers_trtllm.bench.timing import time_fn  # noqa: E402
from diffusers_trtllm.config import QuantConfig  # noqa: E402
from diffusers_trtllm.kernels.sage_sm90 import sage_sm90_attention, sage_sm90_quantize  # noqa: E402
from diffusers_trtllm.kernels.triton_attn import LOG2E  # noqa: E402
from diffusers_trtllm.kernels.triton_quant import TritonSage  # noqa: E402
from diffusers_trtllm.layout import PackedLayout  # noqa: E402
from diffusers_trtllm.locality import local_attention  # noqa: E402


def recorded_call(model_name: str, call: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Packed ``[tokens, heads, dim]`` Q, K, V of the ``call``-th self-attention call of one forward."""
    spec = MODELS[model_name]
    model = build_model(spec, device=device, dtype=torch.bfloat16)
    inputs = model_inputs(spec, model, t=0.5, device=device, dtype=torch.bfloat16)
    seen: list[torch.Tensor] = []
    count = 0

    def observe(index, q, k, v):
        nonlocal count
        if q.shape[-2] != k.shape[-2]:
            return
        if count == call:
            seen.extend(x[0].transpose(0, 1).contiguous() for x in (q, k, v))
            raise _Enough
        count += 1

    with local_attention(model, spec.contrast), spy_sdpa(observe), torch.no_grad():
        try:
            model(**inputs)
        except _Enough:
            pass
    del model
    torch.cuda.empty_cache()
    return tuple(seen)


def branch_shares(q: torch.Tensor, k: torch.Tensor, scale: float, st: TritonSage, heads: int = 4) -> dict:
    """Share of (16-row, 128-key tile) pairs that rescale O, and that take the exact exponent path (first heads),
    from ``st``, what the route's quantizer made of ``q`` and ``k``."""
    tokens = q.shape[0]
    n_tiles = math.ceil(tokens / 128)
    qmax = F.pad(st.q_scale[:heads, :tokens] * scale * LOG2E, (0, (-tokens) % 16)).view(heads, -1, 16).amax(-1)
    kmax = st.k_scale[:heads, : 4 * n_tiles].reshape(heads, n_tiles, 4).amax(-1)
    exact = (qmax[:, :, None] * kmax[:, None, :] >= 2.0**-8).float().mean().item()
    moved = total = 0
    for h in range(heads):
        qh, kh = q[:, h].float(), (k[:, h].float() - (st.k_mean[h] if st.k_mean is not None else 0))
        for start in range(0, tokens, 4096):
            s = qh[start:start + 4096] @ kh.T
            s = F.pad(s, (0, n_tiles * 128 - tokens), value=-math.inf).view(s.shape[0], n_tiles, 128).amax(-1)
            before = torch.cat([torch.full_like(s[:, :1], -math.inf), s.cummax(1).values[:, :-1]], 1)
            rows = s.shape[0] - s.shape[0] % 16
            up = (s > before)[:rows].view(-1, 16, n_tiles).any(1)
            moved += up.sum().item()
            total += up.numel()
    return {"rescale_share": moved / total, "exact_path_share": exact}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wan2.1-t2v-14b", choices=sorted(MODELS))
    p.add_argument("--shape", default="wan_14b_480p", help="the attention benchmark's shape of the same call")
    p.add_argument("--call", type=int, default=0, help="which self-attention call of the forward")
    p.add_argument("--threshold", type=float, default=0.03)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    quant = QuantConfig("int8")  # the route's default: K blocks of 128 split per thread, smooth_k
    inputs = {"e2e call": recorded_call(args.model, args.call, dev)}
    for spread in (0.0, 1.0):
        inputs[f"bench, reach spread {spread:g}"] = tuple(
            x[0].contiguous() for x in structured_qkv(SHAPES[args.shape], 0.5, device=dev, reach_spread=spread))
    report = {}
    for name, (q, k, v) in inputs.items():
        layout = PackedLayout.dense(1, q.shape[0], k.shape[0], dev)
        scale = q.shape[-1] ** -0.5
        quantized = sage_sm90_quantize(q, k, v, layout, quant)
        calls = {
            "cudnn": external_impls(dev, q.dtype)[BASELINE_CUDA][0](q[None], k[None], v[None], scale),
            "sage-sm90": lambda: sage_sm90_attention(q, k, v, layout, softmax_scale=scale, quant=quant),
            "kernel only": lambda: sage_sm90_attention(q, k, v, layout, softmax_scale=scale, quant=quant,
                                                       quantized=quantized),
            f"skip {args.threshold:g}": lambda: sage_sm90_attention(
                q, k, v, layout, softmax_scale=scale, quant=quant, skip_factor=args.threshold * k.shape[0]),
        }
        row = {label: time_fn(fn, dev, warmup=2, iters=10, max_seconds=30.0).median_ms for label, fn in calls.items()}
        stats = sage_sm90_attention(q, k, v, layout, softmax_scale=scale, quant=quant,
                                    skip_factor=args.threshold * k.shape[0], collect_stats=True)
        row["skipped"] = stats.skipped_tiles / stats.total_tiles
        row.update(branch_shares(q, k, scale, quantized))
        row.update(q_rms=q.float().pow(2).mean().sqrt().item(), k_rms=k.float().pow(2).mean().sqrt().item())
        report[name] = row
        print(name, " ".join(f"{key} {val:.4g}" for key, val in row.items()), flush=True)
    if args.out is not None:
        result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
                  "inputs": report}
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(markdown(result))


def markdown(result: dict) -> str:
    """Each input's times (ms) and branch shares as one Markdown table."""
    rows = result["inputs"]
    columns = list(next(iter(rows.values())))
    lines = [f"GPU {result['gpu']}; `{result['command']}`", "",
             "Times in ms (median of 10 calls); `skipped`: the kernel's own count at the skip row's threshold; "
             "`rescale_share` / `exact_path_share`: (16-row, 128-key tile) pairs where some row's running max moves / "
             "where the fast exponent's condition fails, on the first four heads.", "",
             "| input | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {name} | " + " | ".join(f"{row[c]:.4g}" for c in columns) + " |" for name, row in rows.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
