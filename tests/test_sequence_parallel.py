"""Sequence parallelism: the collectives, the recognition, the lowering, the proof and real runs."""
from __future__ import annotations

import threading

import pytest
import torch

from mist_compiler.ir.plan import Plan, PlanError
from mist_compiler.ops.groups import ThreadGroup
from mist_compiler.ops.sequence_parallel import SequenceCollect, SequenceGather, SequenceScatter, SequenceSplit


def _on_threads(world: int, body):
    """Run ``body(group)`` on ``world`` thread-ranks; their results by rank."""
    shared = ThreadGroup.Shared(world)
    results, errors = {}, []

    def main(rank: int) -> None:
        try:
            results[rank] = body(ThreadGroup(shared, rank))
        except BaseException as error:  # surfaced below
            errors.append(error)
            shared.barrier.abort()

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("dim", [1, 0, 2])
def test_gather_and_scatter_are_megatrons_pair(dim):
    world = 2
    full = torch.randn(4, 6, 4, dtype=torch.float64)
    weight = torch.randn(4, 6, 4, dtype=torch.float64)

    def body(group):
        chunk = full.narrow(dim, group.rank * full.shape[dim] // world, full.shape[dim] // world).clone()
        chunk.requires_grad_(True)
        whole = SequenceGather(group)(chunk, dim=dim)  # all-gather forward
        partial = whole * weight * (group.rank + 1)  # each rank's partial sum
        back = SequenceScatter(group)(partial, dim=dim)  # reduce-scatter forward
        back.sum().backward()  # all-gather, then reduce-scatter backward
        return whole.detach(), back.detach(), chunk.grad

    results = _on_threads(world, body)
    expected_sum = full * weight * 3  # (1 + 2) over the two ranks
    for rank, (whole, back, grad) in results.items():
        assert torch.equal(whole, full)
        size = full.shape[dim] // world
        assert torch.allclose(back, expected_sum.narrow(dim, rank * size, size))
        # d/d chunk of sum over ranks of scatter(gather(chunk) * w * (r + 1)): 3 * w on this chunk
        assert torch.allclose(grad, (3 * weight).narrow(dim, rank * size, size))


def test_split_and_collect_keep_replicated_values_replicated():
    world = 2
    full = torch.randn(2, 8, 4, dtype=torch.float64)

    def body(group):
        x = full.clone().requires_grad_(True)
        chunk = SequenceSplit(group)(x, dim=1)
        assert chunk.is_contiguous() and chunk.untyped_storage().nbytes() == chunk.numel() * 8
        again = SequenceCollect(group)(chunk * 2, dim=1)
        again.pow(2).sum().backward()
        return again.detach(), x.grad

    for whole, grad in _on_threads(world, body).values():
        assert torch.allclose(whole, 2 * full)
        assert torch.allclose(grad, 8 * full)  # the replicated value's whole gradient on every rank


def _plan(**stage) -> dict:
    base = {"layers": [0, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 4, "dp": 1, "tp": 2}
    return {"model": "gpt-tiny", "seq_len": 64, "global_batch": 4, "dtype": "float32", "grad_accum": 1,
            "stages": [{**base, **stage}]}


def test_plan_field_sp_is_optional_and_validated():
    plan = Plan.from_dict(_plan())
    assert plan.stages[0].sp is False and "sp" not in plan.to_dict()["stages"][0]  # old plans keep their schema
    assert Plan.from_dict(_plan(sp=True)).to_dict()["stages"][0]["sp"] is True
    with pytest.raises(PlanError, match=r"stages\[0\]\.sp: .*needs tp > 1"):
        Plan.from_dict(_plan(sp=True, tp=1, dp=2))
    with pytest.raises(PlanError, match=r"stages\[0\]\.sp: expected true or false"):
        Plan.from_dict(_plan(sp="yes"))
    with pytest.raises(PlanError, match=r"stages\[0\]\.sp: .*seq_len 63 divisible by tp = 2"):
        Plan.from_dict({**_plan(sp=True), "seq_len": 63})


@pytest.fixture(scope="module")
def gpt_tiny():
    from mist_compiler import driver

    return driver.capture("gpt-tiny", dtype="float32", seq_len=64, analyse=False)


def test_recognition_finds_megatrons_edges(gpt_tiny):
    sp = gpt_tiny.model_graph.sp
    assert sp.supported, sp.reason
    for region in sp.regions.values():
        assert region.hidden_dim == 1
        assert len(region.gathers) == 2 and len(region.scatters) == 2  # into attention and MLP, out of each
        assert set(region.gathers.values()) == {1} and set(region.scatters.values()) == {1}


def test_lowering_rewrites_the_edges_and_chunks_pipeline_boundaries(gpt_tiny):
    from mist_compiler.ir.topology import RankCoord
    from mist_compiler.lowering.lower import lower_stage

    stages = [{"layers": [0, 2], "nodes": 1, "gpus_per_node": 2, "micro_batch": 4, "dp": 1, "tp": 2, "sp": True},
              {"layers": [2, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 4, "dp": 1, "tp": 2, "sp": True}]
    plan = Plan.from_dict({**_plan(), "stages": stages})
    first = lower_stage(gpt_tiny, plan, RankCoord(0, 0, 0))
    second = lower_stage(gpt_tiny, plan, RankCoord(1, 0, 0))
    targets = [n.target for n in first.layer_units[0].graph.nodes if n.op == "call_module"]
    assert targets.count("tp.sp_gather") == 2 and targets.count("tp.sp_scatter") == 2
    assert "tp.reduce" not in targets
    assert targets.count("tp.copy") >= 2  # the norm weights' gradients are summed over the chunks
    top = [n.target for n in first.graph.nodes if n.op == "call_module"]
    assert "tp.sp_split" in top and "tp.sp_collect" not in top  # chunks are sent to stage 1
    assert first.interface.outputs[0].sample_shape == (32, 64)  # half of the 64 positions
    assert second.interface.inputs[0].sample_shape == (32, 64)
    assert "tp.sp_collect" in [n.target for n in second.graph.nodes if n.op == "call_module"]  # before the head
    mixed = Plan.from_dict({**_plan(), "stages": [stages[0], {**stages[1], "sp": False}]})
    assert lower_stage(gpt_tiny, mixed, RankCoord(0, 0, 0)).interface.outputs[0].sample_shape == (64, 64)


def test_the_proof_runs_the_sequence_parallel_program(gpt_tiny):
    from mist_compiler.verify.tp_check import prove_tensor_parallel

    prove_tensor_parallel(gpt_tiny, 2, sp=True)  # loss and every gradient as in one process


def test_models_that_cannot_run_sequence_parallel_are_refused_naming_the_op(tmp_path):
    from hf_configs import write_config

    from mist_compiler import driver
    from mist_compiler.lowering.lower import check_plan_against_program
    from mist_compiler.passes.sequence_parallel import SequenceParallelError

    program = driver.capture(write_config("gpt2", str(tmp_path)), dtype="float32", seq_len=16, analyse=False)
    sp = program.model_graph.sp
    assert not sp.supported and "view" in sp.reason and "transformer.h.0" in sp.reason
    plan = Plan.from_dict({"model": "x", "seq_len": 16, "global_batch": 2, "dtype": "float32", "grad_accum": 1,
                           "stages": [{"layers": [0, 3], "nodes": 1, "gpus_per_node": 2, "micro_batch": 2, "dp": 1,
                                       "tp": 2, "sp": True}]})
    with pytest.raises(SequenceParallelError, match=r"stages\[0\]\.sp: sequence parallelism is not possible"):
        check_plan_against_program(plan, program)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_hugging_face_layers_run_sequence_parallel(tmp_path, kind):
    from hf_configs import write_config

    from mist_compiler import driver
    from mist_compiler.verify.tp_check import prove_tensor_parallel

    program = driver.capture(write_config(kind, str(tmp_path)), dtype="float32", seq_len=16, analyse=False)
    assert program.model_graph.sp.supported, program.model_graph.sp.reason
    prove_tensor_parallel(program, 2, sp=True)  # gemma's (1 + weight) norm scale included


@pytest.mark.distributed
def test_sequence_parallel_trains_like_one_process():
    from plan_runs import assert_all_pass, plan_dict, run_plans, stage

    assert_all_pass(run_plans(2, [plan_dict("llama-tiny", 4, 2, [stage((0, 4), tp=2, sp=True)])]))


@pytest.mark.heavy
@pytest.mark.distributed
def test_sequence_parallel_pipeline_trains_like_one_process():
    """Chunks across the cut (both stages sp), and a cut to a stage without sp (gathered first)."""
    from plan_runs import assert_all_pass, plan_dict, run_plans, stage

    plans = [plan_dict("llama-tiny", 4, 2, [stage((0, 2), tp=2, sp=True), stage((2, 4), tp=2, sp=True)]),
             plan_dict("llama-tiny", 4, 2, [stage((0, 2), tp=2), stage((2, 4), tp=2, sp=True)])]
    assert_all_pass(run_plans(4, plans))
