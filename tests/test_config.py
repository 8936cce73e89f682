import math

import pytest

from diffusers_trtllm import QuantConfig, SkipSoftmaxConfig


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"threshold": float("nan")}, "skip_softmax_threshold"),
        ({"threshold": float("inf")}, "skip_softmax_threshold"),
        ({"threshold": -0.1}, "skip_softmax_threshold"),
        ({"threshold": "0.1"}, "skip_softmax_threshold"),
        ({"target_sparsity": 1.5}, "target_sparsity"),
        ({"target_sparsity": -0.1}, "target_sparsity"),
        ({"disabled_until_timestep": 1.01}, "disabled_until_timestep"),
        ({"disabled_until_timestep": float("nan")}, "disabled_until_timestep"),
        ({"threshold": 0.1, "target_sparsity": 0.5}, "exclusive"),
        ({"target_sparsity": 0.5, "a": 1.0}, "both a and b"),
        ({"target_sparsity": 0.5, "a": -1.0, "b": 1.0}, "calibration a"),
        ({"target_sparsity": 0.5, "a": 1.0, "b": float("inf")}, "calibration b"),
    ],
)
def test_skip_config_rejects(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SkipSoftmaxConfig(**kwargs)


def test_skip_error_names_value_and_range():
    with pytest.raises(ValueError) as err:
        SkipSoftmaxConfig(target_sparsity=2.0)
    assert "2.0" in str(err.value) and "[0.0, 1.0]" in str(err.value)


def test_skip_factor_from_threshold_and_calibration():
    assert SkipSoftmaxConfig(threshold=0.05).scale_factor(1000) == pytest.approx(50.0)
    cfg = SkipSoftmaxConfig(target_sparsity=0.7).with_calibration(2822.62, 4.388)
    assert cfg.scale_factor(1000) == pytest.approx(2822.62 * math.exp(4.388 * 0.7))


def test_target_sparsity_without_calibration_raises_when_needed():
    cfg = SkipSoftmaxConfig(target_sparsity=0.7)  # fine to build: a calibration may come later
    with pytest.raises(ValueError, match="needs a calibration"):
        cfg.scale_factor(100)


def test_gating_rule():
    cfg = SkipSoftmaxConfig(threshold=0.1, disabled_until_timestep=0.9)
    assert not cfg.active_at(0.95) and cfg.active_at(0.9) and cfg.active_at(0.1)
    assert not cfg.active_at(None)
    assert SkipSoftmaxConfig(threshold=0.1).active_at(None)
    assert not SkipSoftmaxConfig().active_at(0.1)


def test_from_kwargs_uses_vllm_omni_names():
    cfg = SkipSoftmaxConfig.from_kwargs({"skip_softmax_threshold": 0.05, "disabled_until_timestep": 0.9})
    assert cfg.threshold == 0.05 and cfg.disabled_until_timestep == 0.9
    q = QuantConfig.from_kwargs({"dtype_qk": "int8", "q_block_size": 1, "k_block_size": 16})
    assert q.enabled and q.qk_max == 127.0


@pytest.mark.parametrize(
    "quant, needle",
    [
        ({"dtype_qk": "bfloat16"}, "dtype_qk"),
        ({"dtype_qk": "int4"}, "dtype_qk"),
        ({"dtype_qk": "int8", "q_block_size": 8}, "q_block_size"),
        ({"dtype_qk": "int8", "k_block_size": 32}, "k_block_size"),
        ({"dtype_qk": "int8", "k_block_size": True}, "k_block_size"),
        ({"dtype_qk": "int8", "q_block_size": 128}, r"q_block_size must be one of \(1, 4, 16\)"),
        ({"dtype_qk": "int8", "smooth_k": "yes"}, "smooth_k"),
        ({"dtype_qk": "int8", "k_per_thread": 1}, "k_per_thread must be True, False or None"),
        ({"dtype_qk": "int8", "k_block_size": 4, "k_per_thread": True},
         r"k_per_thread splits K blocks of \(16, 128\) keys; got k_block_size=4"),
        ({"dtype_qk": "int8", "block": 4}, "unknown keys"),
    ],
)
def test_quant_config_rejects(quant, needle):
    with pytest.raises(ValueError, match=needle):
        QuantConfig.from_kwargs(quant)


def test_k_block_is_the_routes_unless_given():
    assert QuantConfig("int8").k_block_size is None and QuantConfig.from_kwargs("int8").k_block_size is None
    assert QuantConfig("int8").with_k_block(128).k_block_size == 128
    assert QuantConfig("int8", 1, 4).with_k_block(128).k_block_size == 4
    with pytest.raises(ValueError, match=r"k_block_size must be one of \(1, 4, 16, 128\) or None \(the route's\)"):
        QuantConfig("int8", 1, 32)


def test_k_per_thread_is_the_routes_unless_given():
    """Left to the route, a K block is split per thread only where the route asks and the block allows it."""
    assert QuantConfig("int8").k_per_thread is None
    assert QuantConfig("int8").with_k_block(128, per_thread=True) == QuantConfig("int8", 1, 128, k_per_thread=True)
    assert QuantConfig("int8").with_k_block(16).k_per_thread is False
    assert QuantConfig("int8", 1, 4).with_k_block(128, per_thread=True).k_per_thread is False  # 4 cannot be split
    assert QuantConfig("int8", 1, 16).with_k_block(128, per_thread=True).k_per_thread is True
    assert QuantConfig("int8", k_per_thread=False).with_k_block(128, per_thread=True).k_per_thread is False
    assert QuantConfig.from_kwargs({"dtype_qk": "int8", "k_per_thread": True}).k_per_thread is True
    settled = QuantConfig("int8", 1, 128, k_per_thread=True)
    assert settled.with_k_block(16) is settled  # nothing left to the route: the same config, none built per call


def test_quant_aliases():
    assert QuantConfig(dtype_qk="fp8").dtype_qk == "fp8_e4m3"
    assert QuantConfig(dtype_qk="fp8_e4m3").qk_max == 448.0
    assert not QuantConfig().enabled
