"""Pricing compiled units (cost/compiled.py): inductor's partition decides what is saved, elementwise
chains cost one memory pass, and a stage model prices a unit compiled or eager as asked."""
from __future__ import annotations

import pytest
import sympy
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from mist_compiler.cost.analysis import analyse_program
from mist_compiler.driver import capture as capture_program
from mist_compiler.cost.compiled import fuse_costs
from mist_compiler.cost.hardware import load_profile
from mist_compiler.cost.op_time import op_class_time
from mist_compiler.cost.stage_api import StageCandidates
from mist_compiler.cost.stage_model import StageCostModel
from mist_compiler.models import zoo_config
from mist_compiler.passes.cost_annotation import B, S, T, propagate_costs


def _chain(x, w, y):
    h = x @ w  # a GEMM, then an elementwise chain, then a GEMM
    z = torch.relu(h + y) * 2.0
    return z @ w


def test_an_elementwise_chain_between_gemms_is_one_memory_pass():
    x, w, y = torch.randn(8, 16), torch.randn(16, 16), torch.randn(8, 16)
    graph = make_fx(_chain)(x, w, y).graph
    costs = propagate_costs(graph, {}, None, "forward")
    fused = fuse_costs(graph, costs, {}, None)
    kinds = [c.op_class for c in fused.costs.nodes if c.op_class != "view"]
    assert kinds == ["matmul", "fused", "matmul"]
    region = next(c for c in fused.costs.nodes if c.op_class == "fused")
    element = 8 * 16 * 4
    assert int(region.bytes) == 3 * element  # reads h and y once, writes z once; nothing in between is stored
    eager = sum(int(c.bytes) for c in costs.nodes if c.op_class == "elementwise")
    assert eager == 7 * element  # add (3 tensors), relu (2), mul (2): each op reads and writes its own
    names = {n.name: n for n in graph.nodes}
    assert {names[name].target for name in fused.transient} == {torch.ops.aten.add.Tensor, torch.ops.aten.relu.default}


def _compiled_and_eager(name: str):
    program = capture_program(name, seq_len=64, dtype="float16")
    return analyse_program(program, compiled=True)[0], analyse_program(program, compiled=False)[0]


def test_a_compiled_llama_layer_saves_what_fused_rmsnorm_and_swiglu_kernels_save():
    """Inductor's partitioner keeps each RMSNorm's fp16 input and fp32 reciprocal root (not the fp32 copies
    eager autograd keeps) and SwiGLU's two projections and product (not silu(gate)): per token, the
    input, both norm outputs, the o-projection's output, q, the expanded k and v, the attention output
    and log-sum-exp, gate, up and their product (what Mist's fused kernels keep, FACTS.md's base case)."""
    cfg = zoo_config("llama-tiny")
    compiled, eager = _compiled_and_eager("llama-tiny")
    per_token = {kind: sympy.expand(blocks["layer"].memory.saved["flash"]).subs(T, 1).coeff(B * S)
                 for kind, blocks in (("compiled", compiled), ("eager", eager))}
    h, f = cfg.hidden, cfg.ffn
    assert per_token["compiled"] == 2 * 4 * h + 2 * 4 + 2 * 4 * h + 4 * cfg.heads + 2 * 3 * f
    # eager: per norm two fp32 copies of the input and an fp16 cast instead of the input; silu(gate) kept
    assert per_token["eager"] - per_token["compiled"] == 2 * (2 * 4 * h + 2 * h - 2 * h) + 2 * f


def test_a_compiled_gpt_layer_saves_what_the_eager_one_does():
    """LayerNorm and GELU are single ops whose saved inputs both programs keep."""
    compiled, eager = _compiled_and_eager("gpt-tiny")
    assert sympy.expand(compiled["layer"].memory.saved["flash"] - eager["layer"].memory.saved["flash"]) == 0


def test_a_compiled_layer_backward_holds_no_gradients_of_the_block_above():
    """A compiled unit's backward returns its parameter gradients together at its end, so a layer's
    backward peak may hold its own gradients longer than the eager one does, but not the head's: they
    are added to ``.grad`` before the layer's backward starts, although an op labelled with the head
    (the add of the residual's gradient) runs inside the layer's backward."""
    program = capture_program("gpt-small", seq_len=64, dtype="float32")  # its head outweighs a layer
    compiled, eager = (analyse_program(program, compiled=flag)[0] for flag in (True, False))
    assert compiled["post"].params > compiled["layer"].params
    sizes = {B: 2, S: 64, T: 1}

    def backward_peak(block) -> float:
        return max(float(sympy.sympify(point).subs(sizes)) for point in block.memory.backward_peaks["flash"])

    assert backward_peak(compiled["layer"]) <= backward_peak(eager["layer"]) + compiled["layer"].params * 4


def test_the_stage_model_prices_compiled_units_faster_and_leaner():
    program = capture_program("llama-tiny", seq_len=64, dtype="float32")
    models = {compiled: StageCostModel(*_model_args(program, compiled), compiled=compiled) for compiled in (True, False)}
    candidate = StageCandidates(num_layers=4, has_pre=True, has_post=True, nodes=1, gpus_per_node=1, micro_batch=4,
                                dp=1, tp=1, zero=0, ckpt_layers=0, offload_weights=0, offload_grads=0,
                                offload_opt=0, offload_acts=0, inflight=1)
    fast, slow = (models[c].evaluate(candidate) for c in (True, False))
    assert fast.stable_s[0] < slow.stable_s[0]
    assert fast.breakdown["acts"][0] < slow.breakdown["acts"][0]
    ops = {c: sum(1 for n in models[c].blocks["layer"].costs.forward.nodes if n.op_class != "view") for c in models}
    assert ops[True] < ops[False] / 2  # one kernel per region instead of one per op
    # both count the same model FLOPs: fusion changes memory passes, not the GEMMs
    assert models[True].model_flops_per_sequence() == models[False].model_flops_per_sequence()


def test_sequence_parallel_layers_are_priced_fused_too():
    """With sequence parallelism a compiled layer still runs its elementwise chains as fused kernels, and
    its TP collectives as eager calls between compiled segments: the sequence-parallel pricing of a
    compiled program fuses the chains and drops their intermediates, as the pricing without it does, and
    takes the eager program's collectives."""
    program = capture_program("llama-tiny", seq_len=64, dtype="float32")
    compiled, eager = (analyse_program(program, compiled=c)[0]["layer"] for c in (True, False))
    fused, unfused = compiled.sequence, eager.sequence
    count = lambda block: sum(1 for n in block.costs.forward.nodes if n.op_class != "view")  # noqa: E731
    assert count(fused) < count(unfused) / 2  # one kernel per region, as without sequence parallelism
    assert count(fused) == count(compiled)
    assert any(n.op_class == "fused" for n in fused.costs.backward.nodes)
    # what it saves is the compiled partition's, sequence-split: no more than without sequence parallelism
    saved = lambda block: float(sympy.sympify(block.memory.saved["flash"]).subs({B: 2, S: 64, T: 2}))  # noqa: E731
    assert saved(fused) <= saved(compiled)
    assert saved(fused) < saved(unfused)
    # the gathers and reduce-scatters run eagerly between compiled segments: the eager program's, not
    # the whole-layer partition's (which saved a partial sum across a reduce-scatter: one more all-reduce)
    for phase in ("forward", "backward"):
        collectives = lambda block: sorted((c.kind, str(c.bytes)) for c in getattr(block.costs, phase).collectives)  # noqa: E731
        assert collectives(fused) == collectives(unfused)


def _model_args(program, compiled: bool):
    blocks, layers = analyse_program(program, compiled=compiled)
    return blocks, load_profile("cpu"), 64, "float32", "flash", program.model_name, layers


def test_fused_kernels_run_at_the_fused_rate_of_the_profile():
    profile = load_profile("cpu")
    profile.efficiency["fused"] = 0.5
    slow = op_class_time(profile, "float32", "fused", 0.0, 1e9)
    del profile.efficiency["fused"]  # absent: the elementwise rate
    assert slow == 2 * op_class_time(profile, "float32", "fused", 0.0, 1e9)


def test_a_plan_says_whether_its_units_are_compiled_and_analyze_prices_that():
    import pytest

    from mist_compiler.cost.analyze import analyze
    from mist_compiler.cost.stage_model import build_stage_cost_model
    from mist_compiler.ir.plan import Plan, PlanError, StagePlan
    from mist_compiler.ir.vocabulary import COMPILED_DEFAULT

    stage = StagePlan(layers=(0, 4), nodes=1, gpus_per_node=1, micro_batch=4, dp=1, tp=1)
    plan = Plan("gpt-tiny", 64, 4, "float32", 1, (stage,), compiled=not COMPILED_DEFAULT)
    data = plan.to_dict()
    assert data["compiled"] is (not COMPILED_DEFAULT) and Plan.from_dict(data) == plan
    assert "compiled" not in Plan("gpt-tiny", 64, 4, "float32", 1, (stage,)).to_dict()  # the default: schema unchanged
    with pytest.raises(PlanError, match="plan field compiled: expected true or false"):
        Plan.from_dict({**data, "compiled": "yes"})
    program = capture_program("gpt-tiny", seq_len=64, dtype="float32")
    eager = build_stage_cost_model(program, "cpu", seq_len=64, dtype="float32", compiled=False)
    with pytest.raises(PlanError, match="plan field compiled: True, but the cost model given prices eager units"):
        analyze(program, Plan.from_dict({**data, "compiled": True}), "cpu", cost_model=eager)
    assert analyze(program, Plan.from_dict({**data, "compiled": True}), "cpu").compiled


def _gelu_chain(x, w):
    return torch.nn.functional.gelu(x @ w) @ w


def test_a_region_holding_gelu_also_pays_the_profiles_compiled_math_per_element():
    """Inductor's erf on a CPU outlasts the region's memory pass; the profile's ``compiled_pointwise_ns``
    prices the excess per element, and a profile without it (a GPU's) adds nothing."""
    import dataclasses

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    graph = make_fx(_gelu_chain)(x, w).graph
    fused = fuse_costs(graph, propagate_costs(graph, {}, None, "forward"), {}, None)
    extra = [c for c in fused.costs.nodes if c.op_class.startswith("pointwise:")]
    assert [(c.op_class, int(c.bytes), int(c.flops)) for c in extra] == [("pointwise:gelu", 8 * 16, 0)]
    region = next(c for c in fused.costs.nodes if c.op_class == "fused")
    assert extra[0].name == region.name  # found with its region (by name the region's cost comes last)
    profile = load_profile("cpu")
    priced = dataclasses.replace(profile, compiled_pointwise_ns={"gelu": 0.5})
    assert op_class_time(priced, "float32", "pointwise:gelu", 0.0, 1e6) == 0.5e-3
    assert op_class_time(dataclasses.replace(profile, compiled_pointwise_ns={}), "float32", "pointwise:gelu", 0.0, 1e6) == 0


def test_the_stage_model_prices_a_compiled_gpt_layers_gelu_beyond_its_memory_pass():
    import dataclasses

    program = capture_program("gpt-tiny", seq_len=64, dtype="float32")
    blocks, layers = analyse_program(program, compiled=True)
    base = dataclasses.replace(load_profile("cpu"), compiled_pointwise_ns={})
    priced = dataclasses.replace(base, compiled_pointwise_ns={"gelu": 1.0, "gelu_backward": 2.0})
    candidate = StageCandidates(num_layers=2, has_pre=True, has_post=True, nodes=1, gpus_per_node=1, micro_batch=4,
                                dp=1, tp=1, zero=0, ckpt_layers=0, offload_weights=0, offload_grads=0,
                                offload_opt=0, offload_acts=0, inflight=1)
    plain, slower = (StageCostModel(blocks, p, 64, "float32", "flash", program.model_name, layers,
                                    compiled=True).evaluate(candidate) for p in (base, priced))
    expected = 2 * 4 * 64 * zoo_config("gpt-tiny").ffn * (1.0 + 2.0) * 1e-9  # two layers, forward GELU + its backward, per element
    assert slower.stable_s[0] - plain.stable_s[0] == pytest.approx(expected, rel=1e-6)


def test_compiled_units_draw_dropout_masks_again_and_pay_for_the_hash(tmp_path):
    """HF GPT-2 trains with dropout 0.1. Compiled units draw each mask again in the backward
    (``lowering.compile``), so the compiled partition saves no boolean mask where the eager program saves
    one per dropout, and each dropout's forward and backward pay the profile's per-element hash."""
    pytest.importorskip("transformers")
    from hf_configs import write_config

    from mist_compiler.cost.compiled import compiled_partition
    from mist_compiler.passes.cost_annotation import program_graphs

    program = capture_program(write_config("gpt2", str(tmp_path / "gpt2")), seq_len=16, dtype="float32")

    def saved_masks(forward) -> int:
        output = next(n for n in forward.graph.nodes if n.op == "output")
        return sum(1 for value in output.args[0]
                   if isinstance(value, torch.fx.Node) and getattr(value.meta.get("val"), "dtype", None) == torch.bool)

    eager, compiled = program_graphs(program), program_graphs(program, compiled_partition)
    dropouts = [n for n in eager.forward.graph.nodes if n.target is torch.ops.aten.native_dropout.default]
    assert len(dropouts) >= 3  # the embedding's, and the layer's (the captured graphs hold one of each block class)
    assert saved_masks(eager.forward) == len(dropouts) and saved_masks(compiled.forward) == 0
    for graph in (compiled.forward, compiled.backward):  # the mask is drawn in each
        costs = propagate_costs(graph.graph, {}, compiled.symbols, "forward")
        extra = [c for c in fuse_costs(graph.graph, costs, {}, compiled.symbols).costs.nodes
                 if c.op_class == "pointwise:native_dropout"]
        assert len(extra) == len(dropouts)
        elements = {sympy.expand(c.bytes) for c in extra}  # the dropped value's elements: [b, s, hidden] or
        assert B * S * 32 in elements and all(e.has(B) for e in elements)  # attention's [b, heads, s, s]
