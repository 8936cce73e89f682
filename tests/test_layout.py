import pytest
import torch

from diffusers_trtllm.layout import LayoutCache, MaskNotSupportedError, PackedLayout, key_padding_mask


def _random_mask(batch, length, generator):
    mask = torch.rand(batch, length, generator=generator) > 0.4
    mask[:, 0] = True
    return mask


@pytest.mark.parametrize("seed", range(5))
def test_round_trip_gathers_valid_tokens_wherever_they_sit(seed):
    g = torch.Generator().manual_seed(seed)
    batch, length = 3, 37
    q_mask, kv_mask = _random_mask(batch, length, g), _random_mask(batch, length, g)
    x = torch.randn(batch, length, 2, 4, generator=g)
    layout = PackedLayout.from_masks(batch, length, length, q_mask=q_mask, kv_mask=kv_mask)
    packed_q, packed_kv = layout.pack_q(x), layout.pack_kv(x)
    assert torch.equal(packed_q, x[q_mask]) and torch.equal(packed_kv, x[kv_mask])
    assert layout.q_lens == tuple(q_mask.sum(1).tolist())
    assert layout.cu_seqlens_kv.dtype == torch.int32
    assert layout.cu_seqlens_kv.tolist() == [0, *torch.cumsum(kv_mask.sum(1), 0).tolist()]
    assert layout.max_seqlen_kv == max(layout.kv_lens) and isinstance(layout.max_seqlen_kv, int)
    back = layout.unpack_q(packed_q)
    assert torch.equal(back[q_mask], x[q_mask])
    assert torch.all(back[~q_mask] == 0), "padded query rows come back as zeros"


def test_padding_in_the_middle():
    # Qwen-Image: [text | image] with padding at the end of the text, i.e. in the middle.
    mask = torch.tensor([[True, True, False, False, True, True, True]])
    x = torch.arange(7.0).reshape(1, 7, 1, 1)
    layout = PackedLayout.from_masks(1, 7, 7, kv_mask=mask)
    assert layout.pack_kv(x).flatten().tolist() == [0, 1, 4, 5, 6]
    assert layout.pack_q(x).shape[0] == 7, "without q_mask every query is kept"


def test_dense_layout_is_a_reshape():
    layout = PackedLayout.dense(2, 5, 3, "cpu")
    assert layout.cu_seqlens_q.tolist() == [0, 5, 10] and layout.cu_seqlens_kv.tolist() == [0, 3, 6]
    x = torch.randn(2, 5, 1, 2)
    assert torch.equal(layout.unpack_q(layout.pack_q(x)), x)


def test_sequence_without_keys_gives_zero_rows_as_sdpa():
    mask = torch.tensor([[True, False], [False, False]])
    layout = PackedLayout.from_masks(2, 2, 2, kv_mask=mask)
    assert layout.q_lens == (2,) and layout.kv_lens == (1,) and layout.min_seqlen_kv == 1
    out = layout.unpack_q(torch.ones(2, 1, 1))
    assert out[0].eq(1).all() and out[1].eq(0).all()
    with pytest.raises(MaskNotSupportedError, match="no sequence with both"):
        PackedLayout.from_masks(2, 2, 2, kv_mask=torch.zeros(2, 2, dtype=torch.bool))


def test_mask_shape_and_dtype_checked():
    with pytest.raises(ValueError, match="bool tensor of shape"):
        PackedLayout.from_masks(2, 3, 3, kv_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs q_mask, kv_mask"):
        PackedLayout.from_masks(2, 3, 3)


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


def test_cu_seqlens_drops_trailing_empty_segments():
    layout = PackedLayout.from_cu_seqlens(_cu([0, 3, 7, 7, 7]), _cu([0, 5, 9, 9, 9]), 4, 5, q_tokens=7, kv_tokens=9)
    assert layout.num_seqs == 2 and layout.kv_lens == (5, 4) and layout.cu_seqlens_q.tolist() == [0, 3, 7]
    assert layout.min_seqlen_kv == 4


def test_suffix_padding_shortcut():
    layout = PackedLayout.from_cu_seqlens(
        _cu([0, 6]), _cu([0, 5]), 6, 5, q_tokens=8, kv_tokens=8, valid_q_tokens=6, valid_kv_tokens=5
    )
    x = torch.randn(8, 1, 2)
    assert torch.equal(layout.pack_kv(x), x[:5])
    out = layout.unpack_q(layout.pack_q(x))
    assert torch.equal(out[0, :6], x[:6]) and torch.all(out[0, 6:] == 0)


def _layouts():
    kv_mask = torch.tensor([[True, True, False, True, True, True, True], [True] * 7])
    return {
        "dense": PackedLayout.dense(2, 7, 7, "cpu"),
        "masked": PackedLayout.from_masks(2, 7, 7, kv_mask=kv_mask),
        "ragged": PackedLayout.from_cu_seqlens(_cu([0, 3, 7]), _cu([0, 4, 7]), 4, 4, q_tokens=7, kv_tokens=7),
        "suffix": PackedLayout.from_cu_seqlens(_cu([0, 5]), _cu([0, 6]), 5, 6, q_tokens=7, kv_tokens=7,
                                               valid_q_tokens=5, valid_kv_tokens=6),
    }


@pytest.mark.parametrize("kind", ["dense", "masked", "ragged", "suffix"])
def test_pack_is_pack_q_and_pack_kv(kind):
    layout = _layouts()[kind]
    assert layout.in_place == (kind in ("dense", "ragged")), "only where every token is valid and in place"
    # Non-contiguous [batch, tokens, heads, dim] views, as a transposed projection gives them.
    q, k, v = (torch.randn(layout.batch, 3, 7, 2).transpose(1, 2) for _ in range(3))
    packed = layout.pack(q, k, v)
    for got, want in zip(packed, (layout.pack_q(q), layout.pack_kv(k), layout.pack_kv(v))):
        assert got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        ((_cu([0, 3]), _cu([0, 3]), 3.0, 3), {"q_tokens": 3, "kv_tokens": 3}, "Python int"),
        ((_cu([0, 3]), _cu([0, 3]), 3, 3), {"q_tokens": 4, "kv_tokens": 3}, "cover all tokens"),
        ((_cu([0, 3]).long(), _cu([0, 3]), 3, 3), {"q_tokens": 3, "kv_tokens": 3}, "int32"),
        ((_cu([[0, 3]]), _cu([0, 3]), 3, 3), {"q_tokens": 3, "kv_tokens": 3}, "one-dimensional"),
        ((_cu([0, 3, 5]), _cu([0, 3]), 3, 3), {"q_tokens": 5, "kv_tokens": 3}, "same number"),
        ((_cu([0, 3, 2]), _cu([0, 3, 3]), 3, 3), {"q_tokens": 2, "kv_tokens": 3}, "never decrease"),
        ((_cu([0, 3]), _cu([0, 3]), 2, 3), {"q_tokens": 3, "kv_tokens": 3}, "smaller than the longest"),
        ((_cu([0, 2, 3]), _cu([0, 0, 3]), 2, 3), {"q_tokens": 3, "kv_tokens": 3}, "no keys"),
        (
            (_cu([0, 3]), _cu([0, 3]), 3, 3),
            {"q_tokens": 4, "kv_tokens": 4, "valid_q_tokens": 2, "valid_kv_tokens": 3},
            "canonical",
        ),
        (
            (_cu([0, 2]), _cu([0, 3]), 3, 3),
            {"q_tokens": 4, "kv_tokens": 4, "valid_q_tokens": 2, "valid_kv_tokens": 3},
            "must equal the valid lengths",
        ),
        (
            (_cu([0, 5]), _cu([0, 3]), 5, 3),
            {"q_tokens": 4, "kv_tokens": 4, "valid_q_tokens": 5, "valid_kv_tokens": 3},
            "valid_q_tokens",
        ),
    ],
)
def test_cu_seqlens_validation(args, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        PackedLayout.from_cu_seqlens(*args, **kwargs)


@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor([[True, True, False]]),
        torch.tensor([[[[True, True, False]]]]),
        torch.tensor([[0.0, 0.0, float("-inf")]]),
        torch.tensor([[[0.0, 0.0, -10000.0]]]),
        torch.tensor([[0.0, 0.0, torch.finfo(torch.float32).min]]),
    ],
)
def test_key_padding_mask_forms(mask):
    assert key_padding_mask(mask, 1, 4, 3).tolist() == [[True, True, False]]


def test_key_padding_mask_rejects_bias_and_per_query_masks():
    with pytest.raises(MaskNotSupportedError, match="bias"):
        key_padding_mask(torch.tensor([[0.0, -0.5, 0.0]]), 1, 2, 3)
    per_query = torch.ones(1, 1, 2, 3, dtype=torch.bool)
    per_query[0, 0, 1, 0] = False
    with pytest.raises(MaskNotSupportedError, match="varies per query"):
        key_padding_mask(per_query, 1, 2, 3)
    with pytest.raises(MaskNotSupportedError, match="kv_len"):
        key_padding_mask(torch.ones(1, 4, dtype=torch.bool), 1, 2, 3)


def test_layout_cache_builds_once_per_mask_object():
    cache, builds = LayoutCache(), []
    mask = torch.tensor([[True, False, True]])

    def build():
        builds.append(1)
        return PackedLayout.from_masks(1, 3, 3, kv_mask=mask)

    first = cache.get(mask, "k", build)
    assert cache.get(mask, "k", build) is first and len(builds) == 1
    mask[0, 1] = True  # in-place change bumps the version: rebuilt
    cache.get(mask, "k", build)
    assert len(builds) == 2
    other = mask.clone()
    cache.get(other, "k", build)
    assert len(builds) == 3


def test_run_attention_checks_a_callers_layout():
    from diffusers_trtllm import run_attention

    layout = PackedLayout.from_cu_seqlens(_cu([0, 3, 7]), _cu([0, 3, 7]), 4, 4, q_tokens=7, kv_tokens=7)
    x = torch.randn(1, 7, 2, 8)
    out, _ = run_attention(x, x, x, layout=layout)
    assert out.shape == (1, 7, 2, 8)
    with pytest.raises(ValueError, match="token slots"):
        run_attention(x[:, :6], x[:, :6], x[:, :6], layout=layout)
    with pytest.raises(ValueError, match="attn_mask or layout"):
        run_attention(x, x, x, layout=layout, attn_mask=torch.ones(1, 7, dtype=torch.bool))


@pytest.mark.parametrize(
    "shapes, kwargs, needle",
    [
        (((2, 8, 4), (2, 8, 4), (2, 8, 4)), {}, r"\[batch, tokens, heads, head_dim\]"),
        (((1, 8, 4, 16), (1, 9, 4, 16), (1, 8, 4, 16)), {}, "do not agree"),
        (((1, 8, 3, 16), (1, 8, 2, 16), (1, 8, 2, 16)), {}, "multiple of key heads"),
        (((1, 8, 2, 16),) * 3, {"fallback": "sparse"}, "fallback must be"),
        (((1, 8, 2, 16),) * 3, {"backend": "cudnn"}, "unknown backend 'cudnn'"),
    ],
)
def test_run_attention_rejects_bad_inputs(shapes, kwargs, needle):
    from diffusers_trtllm import run_attention

    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=needle):
        run_attention(q, k, v, **kwargs)


def test_explicit_backend_that_cannot_serve_lists_every_route():
    from diffusers_trtllm import NoRouteError, SkipSoftmaxConfig, run_attention, route_names

    x = torch.randn(1, 8, 2, 16)
    with pytest.raises(NoRouteError) as err:
        run_attention(x, x, x, skip=SkipSoftmaxConfig(threshold=0.1), backend="sdpa")
    message = str(err.value)
    assert "backend='sdpa' cannot serve" in message and "fallback='dense'" in message
    assert all(f"{name}:" in message for name in route_names())
