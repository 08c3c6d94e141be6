"""Memory analysis pass: saved activations against closed forms, peaks, and a real run."""
from __future__ import annotations

import functools

import pytest
import sympy
import torch

from mist_compiler.cost.analysis import analyse_program
from mist_compiler.cost.hardware import load_profile
from mist_compiler.cost.stage_api import StageCandidates
from mist_compiler.cost.stage_model import StageCostModel
from mist_compiler.frontend.capture import capture
from mist_compiler.models import build_model, zoo_config
from mist_compiler.passes.cost_annotation import B, S, T
from mist_compiler.passes.memory_analysis import dominates, memory_analysis, prune_candidates

SEQ = 128


@functools.lru_cache(maxsize=4)
def captured(name: str):
    return capture(name, seq_len=SEQ, dtype="float32")


def analysed(name: str):
    program = captured(name)
    blocks, layers = analyse_program(program)
    return blocks, layers, program.model_name


def same(a, b) -> bool:
    return sympy.simplify(sympy.expand(a - b)) == 0


def gpt_layer_saved_closed_form(h: int, f: int, heads: int, nbytes: int = 4) -> sympy.Expr:
    """Bytes a GPT layer keeps per micro-batch (flash attention, no dropout, Megatron-style count).

    Replicated: input, attention-norm output, mid residual, mlp-norm output (4h) and the two
    norms' mean/rstd (fp32, 2 each). Split by t: q, k, v, attention output (4h), up and gelu
    outputs (2f), the fp32 log-sum-exp (one per head).
    """
    return nbytes * B * S * (4 * h + 4 + (4 * h + 2 * f + heads) / T)


def test_gpt_layer_saved_bytes_closed_form_and_capture():
    cfg = zoo_config("gpt-tiny")
    blocks, _, _ = analysed("gpt-tiny")
    layer = blocks["layer"].memory
    assert same(layer.saved["flash"], gpt_layer_saved_closed_form(cfg.hidden, cfg.ffn, cfg.heads))
    # the math kernel also keeps the b*h*s*s probabilities and no log-sum-exp
    extra = 4 * B * cfg.heads * S * S / T - 4 * B * S * cfg.heads / T
    assert same(layer.saved["math"], layer.saved["flash"] + extra)
    assert same(layer.input, 4 * B * S * cfg.hidden)


def test_saved_bytes_agree_with_capture_ir_and_the_pass():
    program = captured("gpt-tiny")
    blocks, _, _ = analysed("gpt-tiny")
    layer_class = next(c for c in program.block_classes.values() if c.kind == "layer")
    assert same(blocks["layer"].memory.saved["flash"].subs(T, 1), layer_class.saved_bytes_expr("flash"))
    result = memory_analysis(program)
    assert not result.modified and not hasattr(program, "memory")  # pure: results on a copy
    assert same(result.program.analysis.memory[layer_class.class_id].saved["flash"], blocks["layer"].memory.saved["flash"])


def test_peaks_cover_saved_plus_gradients():
    cfg = zoo_config("gpt-tiny")
    layer = analysed("gpt-tiny")[0]["layer"].memory
    values = {B: 3, S: 100, T: 1}
    saved = float(layer.saved["flash"].subs(values))
    hidden = 4 * 3 * 100 * cfg.hidden
    forward = max(float(e.subs(values)) for e in layer.forward_peaks["flash"])
    backward = max(float(e.subs(values)) for e in layer.backward_peaks["flash"])
    assert forward >= saved + hidden  # everything saved, plus the output handed on
    assert backward >= saved + hidden  # everything saved, plus the incoming gradient


def test_dominance_and_pruning():
    a, b = 4 * B * S + 16, 2 * B * S + S**2
    assert dominates(a + b, a) and not dominates(a, b) and not dominates(b, a)
    assert dominates(8 * B * S / T + 8 * B * S, 8 * B * S)
    assert set(prune_candidates([a, b, a + b, a])) == {sympy.expand(a + b)}
    assert set(prune_candidates([a, b])) == {a, b}



def test_dominance_by_coefficients_agrees_with_the_polynomial_algebra():
    """Candidates are compared on their Laurent coefficients in b, s, t; on random sizes (sharded ones
    divide by t) that decides exactly what the rational-function test decides, and an expression of
    another form (a max) still goes through the algebra."""
    import random

    from mist_compiler.passes.memory_analysis import _coefficients_nonnegative, _laurent

    rng = random.Random(7)
    monomials = [sympy.Integer(1), B, S, B * S, S**2 * B, B * S / T, S / T, 1 / T, B * S**2 / T**2]

    def random_size() -> sympy.Expr:
        return sympy.Add(*(rng.choice([0, 1, 2, 4, 8, sympy.Rational(1, 2), 0.25]) * m
                           for m in rng.sample(monomials, rng.randint(1, 5))))

    for _ in range(300):
        a, b = random_size(), random_size()
        if rng.random() < 0.2:
            a = a + b  # dominance holds
        assert _laurent(a) is not None and _laurent(b) is not None
        assert dominates(a, b) == _coefficients_nonnegative(a - b), (a, b)
    assert _laurent(sympy.Max(B, S)) is None
    assert dominates(sympy.Max(B, S) + B, sympy.Max(B, S))


def _fused_step(model, ids):
    """A function running gpt-tiny's forward with the head fused with its loss, as eager ops and eager
    autograd: dynamo's graph after ``fuse_linear_cross_entropy``, called on its example inputs (the
    model's own parameters and the batch; compiled frames do not run under a dispatch mode)."""
    from mist_compiler.ops import fuse_linear_cross_entropy

    graphs = []

    def backend(gm, example_inputs, **_):
        assert fuse_linear_cross_entropy(gm)
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=backend, dynamic=False)(input_ids=ids, labels=ids)
    torch._dynamo.reset()
    gm, inputs = graphs[-1]
    return lambda: gm(*inputs)[0]


@pytest.mark.parametrize("fused", [False, True])
def test_predicted_peak_matches_a_real_run(fused):
    """Peak of live tensors in a real fp32 forward+backward of gpt-tiny (Adam states allocated; the
    gradients appear during the backward, as in the backend), with the unfused loss (eager) and with
    the fused head + loss (the dynamo graph with ``mist::linear_cross_entropy``, run eagerly)."""
    from mist_compiler.cost.analysis import analyse_program
    from mist_compiler.driver import capture as capture_program
    from mist_compiler.frontend.joint import loss_fusion
    from mist_compiler.profiling.live_memory import DevicePeakMemory

    with loss_fusion(fused):
        blocks, num_layers = analyse_program(capture_program("gpt-tiny", seq_len=SEQ, dtype="float32"))
    batch, seq, ckpt = 4, 64, 0
    cost = StageCostModel(blocks, load_profile("cpu"), seq, "float32", "flash", "gpt-tiny", num_layers)
    estimate = cost.evaluate(StageCandidates(
        num_layers=num_layers, has_pre=True, has_post=True, nodes=1, gpus_per_node=1, micro_batch=batch, dp=1, tp=1,
        zero=0, ckpt_layers=ckpt, offload_weights=0.0, offload_grads=0.0, offload_opt=0.0, offload_acts=0.0, inflight=1))
    ids = torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(0))
    model = build_model("gpt-tiny")
    step = _fused_step(model, ids) if fused else (lambda: model(input_ids=ids, labels=ids))
    with DevicePeakMemory("cpu") as probe:
        probe.track(*model.parameters())
        optimizer = torch.optim.AdamW(model.parameters())
        step().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        probe.reset_peak()
        step().backward()
        measured = probe.peak_bytes
    assert abs(float(estimate.peak_memory_bytes[0]) / measured - 1) < 0.03


def test_a_tied_head_is_borrowed_and_its_gradient_apart_from_stages_without_the_head():
    """gpt-small with its head tied to the token embedding: the post block reads the embedding's weight
    (``borrowed``), and the backward of the whole model carries the head's gradient part from the post
    block's backward to the embedding's, which adds its own. A stage without the post block never holds
    it: there (``apart``) a layer's backward peaks drop the head's gradient (and the fused loss's hidden
    gradient, whose tuple it kept alive)."""
    cfg = zoo_config("gpt-small")
    blocks, _, _ = analysed("stage_runtime_cases:gpt_small_tied")
    assert same(blocks["post"].borrowed, cfg.vocab * cfg.hidden / T)
    assert blocks["pre"].borrowed == 0 and blocks["layer"].borrowed == 0 and blocks["post"].apart is None
    values = {B: 2, S: SEQ, T: 1}
    for kind in ("pre", "layer"):
        whole = max(e.subs(values) for e in blocks[kind].memory.backward_peaks["flash"])
        apart = max(e.subs(values) for e in blocks[kind].apart.backward_peaks["flash"])
        head, hidden_grad = 4 * cfg.vocab * cfg.hidden, 4 * 2 * SEQ * cfg.hidden
        assert head <= whole - apart <= (2 * head if kind == "pre" else head) + hidden_grad, (kind, whole, apart)
    untied, _, _ = analysed("gpt-small")
    assert untied["post"].borrowed == 0 and untied["layer"].apart is None
