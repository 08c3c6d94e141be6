"""Compiled units (``lowering/compile.py``): inductor-compiled stage programs train exactly like the eager ones.

The rest of the suite runs units eagerly (``MIST_COMPILE=0`` in conftest: a first compile takes tens of
seconds here); these tests turn compilation on. They share one model and one set of shapes (gpt-tiny,
micro-batch 2, sequence 16), so after the first compile the others load their graphs from inductor's
on-disk cache. Every plan kind goes through ``--check``'s comparison with one-process training; the
heaviest combinations (three stages, a Hugging Face model, llama) are marked ``heavy``.
"""
from __future__ import annotations

import operator
import os

import pytest
import torch
import torch.fx as fx

from mist_compiler.ir.plan import Plan
from mist_compiler.ir.topology import RankCoord
from mist_compiler.lowering.compile import CompileStats, compile_stage, split_segments
from mist_compiler.lowering.lower import lower
from mist_compiler.lowering.materialize import ModuleTensors
from mist_compiler.models import build_model
from mist_compiler.verify.check import synthetic_batch
from plan_runs import assert_all_pass, plan_dict, run_plans, stage

MODEL, SEQ, MICRO = "gpt-tiny", 16, 2


@pytest.fixture(autouse=True)
def compiled_by_default(monkeypatch):
    monkeypatch.setenv("MIST_COMPILE", "1")  # ranks spawned by the tests inherit it


def _plan(ckpt_layers: int = 0, offload: dict | None = None) -> Plan:
    return Plan.from_dict(plan_dict(MODEL, MICRO, 1, [stage((0, 4), ckpt_layers=ckpt_layers, offload=offload or {})],
                                    seq=SEQ))


def _stage(program, plan: Plan, model, compiled: bool):
    built = lower(program, plan, RankCoord(0, 0, 0), ModuleTensors(model), device=torch.device("cpu"))
    built.materialize_all()  # (the runtime would give each unit its values as it lays them out)
    return built, compile_stage(built, enabled=compiled)


def _saved_bytes(run) -> int:
    """Bytes of the distinct storages the autograd graph saves while ``run()`` executes (what an outer
    saved-tensor hook, the runtime's activation offload, sees)."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = run()
    return result, sum(storages.values())


def _train_once(built, batch):
    loss, saved = _saved_bytes(lambda: built.module(**batch))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in built.module.named_parameters()}
    return loss.detach(), grads, saved


def test_segments_cut_at_the_tensor_parallel_collectives():
    graph = fx.Graph()
    x, w, labels = graph.placeholder("x"), graph.get_attr("weight"), graph.placeholder("labels")
    y = graph.call_function(torch.nn.functional.linear, (x, w))
    copied = graph.call_module("tp.copy", (y,))
    fused = graph.call_module("tp.linear_cross_entropy", (copied, w, labels))
    loss = graph.call_function(operator.getitem, (fused, 0))
    graph.output(graph.call_function(torch.mul, (loss, 2.0)))
    program = split_segments(graph)
    assert [s.eager for s in program.segments] == [False, True, False]
    assert [n.name for n in program.segments[1].nodes] == ["tp_copy", "tp_linear_cross_entropy", "getitem"]
    assert program.segments[0].outputs == ["linear"] and program.segments[2].inputs == ["getitem"]
    assert program.attrs == {"weight": "weight"}


def test_a_compiled_unit_draws_its_dropout_mask_again_rather_than_save_it():
    """The runtime's dropout mask is a hash of each element's place (``ops.dropout``): a compiled unit
    draws it again in the backward (about 1 ns an element here) instead of saving a boolean mask
    (inductor's store of it cost 7), with the eager program's values and gradients."""
    from torch import nn

    from mist_compiler.lowering.compile import CompiledUnit
    from mist_compiler.ops.dropout import counter_attention, counter_dropout, sample_seeds

    graph = fx.Graph()
    x, seeds, weight = graph.placeholder("x"), graph.placeholder("seeds"), graph.get_attr("weight")
    hidden = graph.call_function(torch.nn.functional.linear, (x, weight))
    dropped = graph.call_function(counter_dropout, (hidden, 0.25, seeds, 2, 0))
    heads = graph.call_method("view", (dropped, 4, 8, 2, 16))
    heads = graph.call_method("transpose", (heads, 1, 2))
    attended = graph.call_function(counter_attention, (heads, heads, heads), {  # dropout on the probabilities too
        "attn_mask": None, "dropout_p": 0.5, "is_causal": True, "scale": None, "enable_gqa": False,
        "seeds": seeds, "layer": 2, "site": 1})
    graph.output((graph.call_function(torch.tanh, (dropped,)), attended))
    module = nn.Module()
    module.weight = nn.Parameter(torch.randn(32, 32))
    eager, compiled = fx.GraphModule(module, graph), CompiledUnit(module, split_segments(graph), CompileStats())
    inputs = (torch.randn(4, 8, 32), sample_seeds(0, 0, torch.arange(4)))
    results = []
    for run in (eager, compiled):
        saved = []

        def pack(tensor):
            if tensor.dtype == torch.bool:
                saved.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out, attention = run(*inputs)
        (out.square().sum() + attention.square().sum()).backward()
        results.append(((out.detach(), attention.detach()), module.weight.grad.clone(), saved))
        module.weight.grad = None
    (out, grad, saved), (compiled_out, compiled_grad, compiled_saved) = results
    masks = {(4, 8, 32), (4, 2, 8, 8)}  # the two dropped values' (the causal mask [8, 8] is saved by both)
    assert masks <= set(saved) and not masks & set(compiled_saved)
    assert (out[0] == 0).float().mean().item() == pytest.approx(0.25, abs=0.05)  # it does drop
    for compiled_value, value in zip(compiled_out, out):
        torch.testing.assert_close(compiled_value, value)
    torch.testing.assert_close(compiled_grad, grad, rtol=1e-3, atol=1e-5)  # a different mask is off by O(1)


def test_a_split_values_dropout_compiles_in_and_draws_this_ranks_part_of_the_mask():
    """``tp.dropout`` has no collective: a compiled segment keeps it (its mask drawn again in the backward)
    and it equals the eager ``SplitDropout`` of the same rank."""
    from types import SimpleNamespace

    from torch import nn

    from mist_compiler.lowering.compile import CompiledUnit
    from mist_compiler.ops.dropout import sample_seeds
    from mist_compiler.ops.tensor_parallel import TensorParallelOps

    graph = fx.Graph()
    x, seeds = graph.placeholder("x"), graph.placeholder("seeds")
    dropped = graph.call_module("tp.dropout", (x, 0.3, seeds, 1, 2), {"dim": 2, "block": 64, "parts": ()})
    graph.output(graph.call_function(torch.tanh, (dropped,)))
    program = split_segments(graph)
    assert [s.eager for s in program.segments] == [False]
    module = nn.Module()
    module.tp = TensorParallelOps(SimpleNamespace(rank=1, world=2))  # no collective is called
    inputs = (torch.randn(4, 8, 32, requires_grad=True), sample_seeds(0, 0, torch.arange(4)))
    eager, compiled = fx.GraphModule(module, graph)(*inputs), CompiledUnit(module, program, CompileStats())(*inputs)
    torch.testing.assert_close(compiled, eager)
    eager_grad, = torch.autograd.grad(eager.sum(), inputs[0])
    compiled_grad, = torch.autograd.grad(compiled.sum(), inputs[0])
    torch.testing.assert_close(compiled_grad, eager_grad)
    assert 0.2 < (eager == 0).float().mean().item() < 0.4


def test_compiled_stage_trains_like_the_eager_one(gpt_tiny_program):
    torch.manual_seed(0)
    model = build_model(MODEL, seq_len=SEQ)
    batch = synthetic_batch(512, MICRO, SEQ, 0)
    eager, off = _stage(gpt_tiny_program, _plan(), model, compiled=False)
    compiled, stats = _stage(gpt_tiny_program, _plan(), model, compiled=True)
    assert off.describe() == "8 units run eagerly (compilation off)"
    reference, compiled_run = _train_once(eager, batch), _train_once(compiled, batch)
    torch.testing.assert_close(compiled_run[0], reference[0], rtol=1e-5, atol=1e-6)
    for name, grad in reference[1].items():
        torch.testing.assert_close(compiled_run[1][name], grad, rtol=1e-4, atol=1e-6)
    # the four layers run one program: embeddings, layer, final norm and head are five, each compiled once
    assert (stats.units, stats.programs, stats.graphs) == (8, 5, 5)
    assert stats.describe().startswith("compiled 8 units (5 programs, 5 graphs) in ")
    # a second engine of the process reuses the artefacts
    again, again_stats = _stage(gpt_tiny_program, _plan(), model, compiled=True)
    _train_once(again, batch)
    assert again_stats.graphs == 5 and again_stats.from_cache


def test_checkpointed_compiled_units_keep_only_their_inputs(gpt_tiny_program):
    torch.manual_seed(0)
    model = build_model(MODEL, seq_len=SEQ)
    batch = synthetic_batch(512, MICRO, SEQ, 0)
    plain, _ = _stage(gpt_tiny_program, _plan(), model, compiled=True)
    checkpointed, _ = _stage(gpt_tiny_program, _plan(ckpt_layers=4), model, compiled=True)
    loss, grads, saved = _train_once(plain, batch)
    ckpt_loss, ckpt_grads, ckpt_saved = _train_once(checkpointed, batch)
    torch.testing.assert_close(ckpt_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(ckpt_grads[name], grad, rtol=1e-5, atol=1e-7)
    # what the layers' compiled regions save disappears behind the checkpoints (the pre and post units
    # and the layers' inputs stay): a layer of gpt-tiny saves far more than its input
    hidden = MICRO * SEQ * 64 * 4
    assert saved - ckpt_saved > 4 * 4 * hidden


def test_activation_offload_moves_what_compiled_units_save(gpt_tiny_program):
    from mist_compiler.runtime.engine import install_activation_offload
    from mist_compiler.runtime.stage_runtime import AdamWConfig, StageRuntime

    torch.manual_seed(0)
    model = build_model(MODEL, seq_len=SEQ)
    batch = synthetic_batch(512, MICRO, SEQ, 0)
    reference = _train_once(_stage(gpt_tiny_program, _plan(), model, compiled=False)[0], batch)
    built, _ = _stage(gpt_tiny_program, _plan(offload={"acts": 0.5}), model, compiled=True)
    runtime = StageRuntime(built.units, dp_group=None, zero=0, offload=built.offload, optimizer=AdamWConfig(),
                           device=torch.device("cpu"))
    hooks = install_activation_offload(runtime, built.units, built.offload, built.checkpointed)
    try:
        runtime.begin_iteration()
        loss = built.module(**batch)
        layers = [runtime.activations[f"blocks.{i}"] for i in range(4)]
        for offloader in layers:  # within one saved tensor of half of what the compiled region saved
            total = offloader.offloaded_bytes + offloader.kept_bytes
            assert total > 0 and abs(offloader.offloaded_bytes - total / 2) <= total / 4
        loss.backward()
        runtime.finish_gradients()
        torch.testing.assert_close(loss.detach(), reference[0], rtol=1e-5, atol=1e-6)
        grads = runtime.named_full_gradients()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference[1][name], rtol=1e-4, atol=1e-6)
    finally:
        for handle in hooks:
            handle.remove()
        runtime.remove_hooks()


def test_a_unit_compiled_under_a_dispatch_mode_keeps_the_fused_loss_one_op():
    """A unit first called under a caller's dispatch mode (here the memory tracker, which runs a custom
    op's body) compiles the program it would without it. Traced through the mode, the fused loss was
    inlined and the partitioner moved its backward's slices into the forward, which saved every
    vocabulary slice's gradient: the measured peaks of compiled runs were 28 MB above what runs."""
    import mist_compiler.ops  # noqa: F401 (registers mist::linear_cross_entropy)
    from mist_compiler.lowering.compile import compile_segment
    from mist_compiler.profiling.live_memory import DevicePeakMemory

    graph = fx.Graph()
    hidden_node, weight_node, labels_node = (graph.placeholder(name) for name in ("hidden", "weight", "labels"))
    fused = graph.call_function(torch.ops.mist.linear_cross_entropy.default,
                                (hidden_node, weight_node, labels_node, -100, "mean"))
    graph.output((graph.call_function(operator.getitem, (fused, 0)),))
    module = fx.GraphModule(torch.nn.Module(), graph)
    hidden = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(128, 16, requires_grad=True)  # eight vocabulary slices of 16
    labels = torch.randint(0, 128, (64,))
    with DevicePeakMemory("cpu"):
        compiled = compile_segment(module, [hidden, weight, labels])
        (loss,), saved = _saved_bytes(lambda: compiled(hidden, weight, labels))
    loss.backward()
    # the op saves its inputs and the rows' log-sum-exp, nothing per slice
    assert saved == hidden.nbytes + weight.nbytes + labels.nbytes + 64 * 4
    reference = torch.nn.functional.cross_entropy(hidden.detach() @ weight.detach().T, labels)
    assert torch.allclose(loss.detach(), reference, atol=1e-5)


def test_units_with_a_per_tensor_policy_run_eagerly(gpt_tiny_program):
    """A compiled region saves what inductor's partitioner chose, which the policy's markers cannot
    attribute node by node: its units keep their eager program (and the cost model prices them so)."""
    from mist_compiler.lowering.compile import CompiledUnit

    policy = {"recompute": ["layer_norm_1", "linear_4", "gelu"]}
    plan = Plan.from_dict(plan_dict(MODEL, MICRO, 1, [stage((0, 4), ckpt_layers=1, activations=policy)], seq=SEQ))
    built, stats = _stage(gpt_tiny_program, plan, build_model(MODEL, seq_len=SEQ), compiled=True)
    compiled = {name for name, module in built.units if isinstance(module.forward, CompiledUnit)}
    assert set(built.saved) == {"blocks.1", "blocks.2", "blocks.3"}  # the checkpointed layer has no policy
    assert compiled == {name for name, _ in built.units} - set(built.saved)
    assert (stats.units, stats.eager_units) == (len(built.units) - 3, 3)


def test_compile_stats_describe():
    assert CompileStats(units=3, programs=2).describe() == "3 units (2 programs) not compiled yet"
    stats = CompileStats(units=3, programs=2, graphs=2, compiled=0, seconds=1.25)
    assert stats.describe() == "compiled 3 units (2 programs, 2 graphs) in 1.2 s (all from the cache)"
    assert CompileStats(units=1, programs=1, graphs=2, compiled=1).describe().endswith("(1 of them from the cache)")


def test_mistc_run_says_how_long_compilation_took(tmp_path):
    """As users run it: a fresh ``mistc run`` reports its compilation after the first step; --no-compile
    keeps the eager program."""
    import json
    import subprocess
    import sys

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_dict(MODEL, MICRO, 1, [stage((0, 4))], seq=SEQ)))
    mistc = os.path.join(os.path.dirname(sys.executable), "mistc")
    lines = {}
    for flag in ([], ["--no-compile"]):
        result = subprocess.run([mistc, "run", MODEL, "--plan", str(path), "--steps", "2", *flag],
                                capture_output=True, text=True, timeout=1200)
        assert result.returncode == 0, result.stdout + result.stderr
        lines[bool(flag)] = [line for line in result.stdout.splitlines() if "compilation:" in line]
    assert len(lines[False]) == 1 and "mist: compilation: compiled 8 units (5 programs, 5 graphs) in " in lines[False][0]
    assert lines[True] == ["mist: compilation: 8 units run eagerly (compilation off)"]


# --------------------------------------------------------------------------- every plan kind, --check
def test_every_two_rank_plan_kind_checks_compiled():
    """On 2 ranks (one pair of processes, so later plans reuse the graphs the first compiled): DP, ZeRO-3,
    two pipeline stages with checkpointing and offload, TP with the fused vocabulary-parallel loss and
    with the plain one (the collectives run between the compiled regions)."""
    plans = [
        plan_dict(MODEL, 4, 1, [stage((0, 4), dp=2)], seq=SEQ),
        plan_dict(MODEL, 4, 1, [stage((0, 4), dp=2, zero=3)], seq=SEQ),
        plan_dict(MODEL, 4, 2, [stage((0, 2), ckpt_layers=1), stage((2, 4), offload={"acts": 0.5, "weights": 0.5})],
                  seq=SEQ),
        plan_dict(MODEL, 2, 1, [stage((0, 4), tp=2)], seq=SEQ),
        {**plan_dict(MODEL, 2, 1, [stage((0, 4), tp=2)], seq=SEQ), "fused_loss": False},
    ]
    assert_all_pass(run_plans(2, plans, timeout_s=2400))


@pytest.mark.heavy
def test_three_stages_zero_and_llama_check_compiled():
    plans = [plan_dict(MODEL, 6, 3, [stage((0, 1)), stage((1, 3)), stage((3, 4))], seq=SEQ),
             {**plan_dict("llama-tiny", 6, 3, [stage((0, 2), ckpt_layers=1), stage((2, 3)), stage((3, 4))], seq=SEQ),
              "fused_loss": False}]
    assert_all_pass(run_plans(3, plans, timeout_s=2400))
    plans = [plan_dict("llama-tiny", 4, 2, [stage((0, 4), dp=2, zero=z, ckpt_layers=2)], seq=SEQ) for z in (1, 2)]
    plans.append(plan_dict("llama-tiny", 4, 1, [stage((0, 4), tp=2, offload={"acts": 0.5, "grads": 0.5})], seq=SEQ))
    assert_all_pass(run_plans(2, plans, timeout_s=2400))


@pytest.mark.heavy
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hugging_face_plans_check_compiled(kind, tmp_path):
    pytest.importorskip("transformers")
    from hf_configs import write_config
    from test_hf_models import four_rank_plans

    model = write_config(kind, str(tmp_path / kind))
    assert_all_pass(run_plans(4, four_rank_plans(model), timeout_s=3600))


def test_the_backend_and_the_api_take_the_switch(tmp_path):
    from mist_compiler.torch_compile.plan_runtime import DynamoRuntimeError, parse_options

    path = tmp_path / "plan.json"
    path.write_text(_plan().to_json())
    assert parse_options({"plan": str(path), "compile_units": False})["compile_units"] is False
    with pytest.raises(DynamoRuntimeError, match="option 'compile_units' must be True or False"):
        parse_options({"plan": str(path), "compile_units": "no"})
    import torch.distributed as dist

    from mist_compiler import compile as compile_plan

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        off = compile_plan(build_model(MODEL, seq_len=SEQ), _plan(), compile_units=False)
        on = compile_plan(build_model(MODEL, seq_len=SEQ), _plan())  # the plan says compiled (MIST_COMPILE=1 here)
        assert not off.compile_stats.enabled and off.compile_stats.eager_units == 8
        assert on.compile_stats.enabled and on.compile_stats.units == 8
        eager_plan = Plan.from_dict({**_plan().to_dict(), "compiled": False})
        assert not compile_plan(build_model(MODEL, seq_len=SEQ), eager_plan).compile_stats.enabled
    finally:
        dist.destroy_process_group()


def test_a_unit_inductor_cannot_compile_runs_eagerly_and_says_so(gpt_tiny_program, monkeypatch, capsys):
    """No C++ compiler (or an op inductor cannot lower): training goes on eagerly, one line says why."""
    from mist_compiler.lowering import compile as compile_module

    def refuse(module, tensors):
        raise RuntimeError("Compiler: cc is not found\nmore detail")

    monkeypatch.setattr(compile_module, "compile_segment", refuse)
    monkeypatch.setattr(compile_module, "_ARTEFACTS", {})  # nothing from earlier tests of this process
    torch.manual_seed(0)
    model = build_model(MODEL, seq_len=SEQ)
    batch = synthetic_batch(512, MICRO, SEQ, 0)
    eager, _ = _stage(gpt_tiny_program, _plan(), model, compiled=False)
    fallen, stats = _stage(gpt_tiny_program, _plan(), model, compiled=True)
    reference, run = _train_once(eager, batch), _train_once(fallen, batch)
    torch.testing.assert_close(run[0], reference[0])
    for name, grad in reference[1].items():
        torch.testing.assert_close(run[1][name], grad)
    assert stats.failed == stats.graphs == 5 and "5 graphs failed to compile, run eagerly" in stats.describe()
    err = capsys.readouterr().err
    assert err.count("mist: inductor could not compile a unit (RuntimeError: Compiler: cc is not found)") == 1
