"""Diffusers' context parallelism (Ulysses and ring, 2 gloo processes on the CPU) served by our routes.

Ulysses: each rank runs our op on the whole sequence of its heads, so the output equals the
single-process output of the same route (reference, skip-softmax + int8 SAGE) up to float
order, timestep gating matches step for step, and the per-rank skipped tiles add up to the
single process's. Ring: each rank runs our op per KV shard with its log-sum-exp and Diffusers
merges them: dense equals one process; skip-softmax runs the per-shard rule (a subset of one
process's skipped tiles). See docs/design.md, "Context parallelism".
"""

from __future__ import annotations

import json
import os
import queue
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tiny_models
from diffusers_trtllm import TrtllmAttnProcessor, attach_denoise_tracking, install

WORLD = 2
GATE = 0.5
SPARSE = dict(skip_softmax_threshold=0.3, disabled_until_timestep=GATE, backend="reference",
              quant={"dtype_qk": "int8", "k_block_size": 1}, policy="always")
DENSE = dict(backend="reference")
#: (family, processor settings, install before enable_parallelism, timestep divisor, raw timesteps of two steps)
CASES = (
    ("wan_skipping", SPARSE, True, 1000.0, (700.0, 300.0)),
    ("flux", SPARSE, False, 1.0, (0.7, 0.3)),
    ("flux", DENSE, True, 1.0, (0.7, 0.3)),
)


def _build(family: str) -> tuple[torch.nn.Module, dict]:
    """A tiny model; ``wan_skipping``: Wan with 512 tokens whose self-attention skips KV tiles.

    Its self-attention queries are all alike (``to_q`` keeps only its bias, RoPE is the identity)
    and its keys sharp (``norm_k`` x6), so whole 128x128 tiles fall below the skip threshold.
    """
    if family != "wan_skipping":
        return tiny_models.build(family)
    model, inputs = tiny_models.build("wan_t2v")
    with torch.no_grad():
        model.rope.freqs_cos.fill_(1.0)
        model.rope.freqs_sin.fill_(0.0)
        for block in model.blocks:
            block.attn1.to_q.weight.zero_()
            block.attn1.norm_k.weight.mul_(6.0)
    inputs["hidden_states"] = torch.randn(1, 4, 2, 32, 32, generator=torch.Generator().manual_seed(5))
    return model, inputs


def _records(proc) -> list[tuple]:
    return [(layer.name, layer.role, r.step, round(r.t, 3), r.sparse, r.sage, r.route, r.skipped_tiles, r.total_tiles)
            for layer in proc.layers for r in layer.records]


def _run_case(family, settings, install_first, divisor, timesteps, parallel=None):
    """Outputs of two forwards (one per timestep), the per-layer records and the step table, in this process."""
    model, inputs = _build(family)
    proc = TrtllmAttnProcessor(**settings)
    if parallel is not None and not install_first:
        model.enable_parallelism(config=parallel())
    install(model, proc)
    if parallel is not None and install_first:
        model.enable_parallelism(config=parallel())
    attach_denoise_tracking(model, timestep_divisor=divisor)
    outputs = []
    for raw in timesteps:
        inputs["timestep"] = torch.full_like(inputs["timestep"], raw, dtype=torch.float32)
        with torch.no_grad():
            outputs.append(model(**inputs)[0].numpy().copy())  # numpy: sent by value between processes
    return outputs, _records(proc), proc.format_step_table()


def _ulysses_cases() -> list:
    from diffusers import ContextParallelConfig

    def parallel():
        return ContextParallelConfig(ulysses_degree=WORLD)

    return [_run_case(*case, parallel=parallel) for case in CASES]


#: Ring cases: (family, processor settings, install before enable_parallelism, divisor, timesteps).
SKIP_ONLY = dict(skip_softmax_threshold=0.3, backend="reference", policy="always")
RING_CASES = (
    ("wan_skipping", DENSE, True, 1000.0, (700.0, 300.0)),
    ("flux", DENSE, False, 1.0, (0.7, 0.3)),
    ("wan_skipping", SKIP_ONLY, True, 1000.0, (700.0, 300.0)),
)


def _ring_cases(ulysses: int = 1, cases: tuple = RING_CASES) -> list:
    from diffusers import ContextParallelConfig

    def parallel():
        return ContextParallelConfig(ring_degree=WORLD, ulysses_degree=ulysses)

    return [_run_case(*case, parallel=parallel) for case in cases]


def _bench_cp(out: str) -> dict:
    from diffusers_trtllm.bench import cp

    rank = dist.get_rank()  # main() ends the process group
    cp.main(["--variant", "tiny", "--device", "cpu", "--dtype", "float32", "--backend", "reference", "--out", out,
             "--configs", "dense,sage-int8,sage-int8+skip", "--iters", "1", "--warmup", "0"])
    return json.loads((Path(out) / "cp.json").read_text()) if rank == 0 else {}


def _worker(rank: int, world: int, port: int, results, job, args) -> None:
    """One gloo rank of ``world`` (torchrun's environment variables) running ``job(*args)``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    try:
        try:  # Ulysses needs all_to_all_single; some gloo builds lack it
            probe = torch.arange(world, dtype=torch.float32)
            dist.all_to_all_single(torch.empty_like(probe), probe)
        except (RuntimeError, NotImplementedError) as err:
            results.put((rank, "skip", f"gloo lacks all_to_all_single: {err}"))
            return
        # Diffusers computes rank % torch.accelerator.device_count(), which is 0 on a CPU-only torch.
        torch.accelerator.device_count = lambda: 1
        results.put((rank, "ok", job(*args)))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", repr(err)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


#: How long the test waits for each rank's result: a guard against a hung process group, not a speed check.
#: The slowest call (4 ranks on 2 cores) took 22 s on an idle 2-core machine and 68 s with it 3x oversubscribed.
WORKER_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _on_ranks(job, *args, world: int = WORLD) -> list:
    """``job(*args)``'s result on each of ``world`` gloo processes (skips if gloo cannot run Ulysses)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, world, port, results, job, args)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict((rank, (status, payload))
                   for rank, status, payload in (results.get(timeout=WORKER_TIMEOUT_S) for _ in procs))
    except queue.Empty:
        pytest.fail(f"the gloo workers gave no result within {WORKER_TIMEOUT_S} s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for status, payload in got.values():
        if status == "skip":
            pytest.skip(payload)
        assert status == "ok", payload
    return [got[rank][1] for rank in range(world)]


@pytest.fixture(scope="module")
def ranks():
    return _on_ranks(_ulysses_cases)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0]}-{'sparse' if c[1] is SPARSE else 'dense'}-"
                                                        f"{'install_first' if c[2] else 'enable_first'}" for c in CASES])
def test_ulysses_equals_one_process(ranks, case):
    single_outputs, single_records, _ = _run_case(*CASES[case])
    for rank, per_case in enumerate(ranks):
        outputs, records, table = per_case[case]
        assert table.splitlines()[0].startswith(f"statistics of rank {rank} of {WORLD} only"), table
        for step, (out, ref) in enumerate(zip(outputs, single_outputs)):
            out, ref = torch.from_numpy(out), torch.from_numpy(ref)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"rank {rank}, step {step}")
        # Same layers, roles, steps, t, gating, SAGE and route on every rank as on one process.
        assert [r[:7] for r in records] == [r[:7] for r in single_records], f"rank {rank}"
    if CASES[case][1] is SPARSE:
        modes = {(r[2], r[4]) for r in single_records}
        assert modes == {(0, False), (1, True)}, "t=0.7 runs dense and t=0.3 sparse (gate 0.5)"
        # Under Ulysses each rank counts the tiles of its own heads: together they are the single
        # process's. (Wan's cross-attention runs without parallel_config: local queries, every head.)
        for i, single in enumerate(single_records):
            skipped = [per_case[case][1][i][7] for per_case in ranks]
            total = [per_case[case][1][i][8] for per_case in ranks]
            if single[8] and single[1] != "cross":
                assert (sum(skipped), sum(total)) == (single[7], single[8]), single
    if CASES[case][0] == "wan_skipping":
        assert sum(r[7] for r in single_records if r[7]) > 0, "the structured Wan must skip tiles"


@pytest.fixture(scope="module")
def ring_ranks():
    return _on_ranks(_ring_cases)


@pytest.mark.parametrize("case", range(len(RING_CASES)), ids=[f"{c[0]}-{'skip' if c[1] is SKIP_ONLY else 'dense'}"
                                                             for c in RING_CASES])
def test_ring_equals_one_process(ring_ranks, case):
    """Ring degree 2: every rank's output is one process's (dense: up to float order; skip: close, the
    per-shard rule skips a subset of one process's tiles, and each shard's tiles are counted)."""
    single_outputs, single_records, _ = _run_case(*RING_CASES[case])
    skip = RING_CASES[case][1] is SKIP_ONLY
    for rank, per_case in enumerate(ring_ranks):
        outputs, records, table = per_case[case]
        assert table.splitlines()[0].startswith(f"statistics of rank {rank} of {WORLD} only"), table
        for step, (out, ref) in enumerate(zip(outputs, single_outputs)):
            out, ref = torch.from_numpy(out), torch.from_numpy(ref)
            if skip:
                assert ((out - ref).abs().sum() / ref.abs().sum()).item() < 0.05, f"rank {rank}, step {step}"
            else:
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=f"rank {rank}, step {step}")
        assert [r[:7] for r in records] == [r[:7] for r in single_records], f"rank {rank}"
    if skip:
        for i, single in enumerate(single_records):
            if single[8] and single[1] == "self":  # ring splits self-attention's keys; cross runs whole
                skipped = sum(per_case[case][1][i][7] for per_case in ring_ranks)
                total = sum(per_case[case][1][i][8] for per_case in ring_ranks)
                assert total == single[8] and 0 < skipped <= single[7], (skipped, single)


def test_ulysses_by_ring_equals_one_process():
    """Ulysses 2 x ring 2 on 4 gloo processes (tiny Wan, dense reference): Diffusers' unified path around our op."""
    case = RING_CASES[0]
    single_outputs, single_records, _ = _run_case(*case)
    for rank, (per_case,) in enumerate(_on_ranks(_ring_cases, 2, (case,), world=4)):
        outputs, records, table = per_case
        for step, (out, ref) in enumerate(zip(outputs, single_outputs)):
            torch.testing.assert_close(torch.from_numpy(out), torch.from_numpy(ref), rtol=1e-5, atol=1e-5,
                                       msg=f"rank {rank}, step {step}")
        assert [r[:7] for r in records] == [r[:7] for r in single_records], f"rank {rank}"
        assert table.splitlines()[0].startswith(f"statistics of rank {rank} of 4 only"), table


@pytest.mark.parametrize("config, degrees", [
    (dict(ulysses_degree=2), (2, 1)),
    (dict(ulysses_degree=4), (4, 1)),
    (dict(ring_degree=2), (1, 2)),
    (dict(ring_degree=2, ulysses_degree=2), (2, 2)),
    (dict(ulysses_degree=2, ulysses_anything=True), None),
    (dict(ring_degree=2, ring_anything=True), None),
])
def test_which_context_parallel_calls_are_served(config, degrees):
    from diffusers import ContextParallelConfig, ParallelConfig

    from diffusers_trtllm.serving.parallel import served_degrees

    assert served_degrees(ParallelConfig(context_parallel_config=ContextParallelConfig(**config))) == degrees
    assert served_degrees(ParallelConfig()) is None


def test_cp_benchmark_runs_on_gloo(tmp_path):
    """``torchrun -m diffusers_trtllm.bench cp``'s code path on 2 CPU ranks (tiny Wan, reference route)."""
    result = _on_ranks(_bench_cp, str(tmp_path))[0]
    rows = {row["setting"]: row for row in result["rows"]}
    assert list(rows) == ["stock", "dense", "sage-int8", "sage-int8+skip"]
    assert result["ulysses_degree"] == WORLD and result["environment"]["command"].startswith("torchrun")
    assert rows["dense"]["rel_l1_vs_stock"] < 1e-5
    assert rows["sage-int8"]["routes"]["self"] == "reference+sage"
    assert 0 < rows["sage-int8"]["rel_l1_vs_stock"] < 0.05
    table = (tmp_path / "cp.md").read_text()
    assert "over 2 GPU(s)" in table and "| sage-int8+skip |" in table
