"""StageRuntime against single-process torch.optim.AdamW: ZeRO 0-3, offload kinds, 2 and 4 gloo ranks.

Each spawn trains several configurations in sequence (process start costs ~3 s). Error metric per
parameter tensor: ||runtime - reference|| / ||reference|| after 3 AdamW steps (fp32).

Two single-process torch.optim.AdamW references on the same global batches:
- one backward of the whole global batch's mean loss;
- the same gradient accumulated over the dp * G chunks the runtime sees (loss / (dp * G) each).
Both must agree within 1e-5. lr is 1e-4: at 1e-3 the two torch references differ from each other
by up to 6e-5 (Adam's first steps amplify fp32 summation-order noise on elements with near-zero
gradients), so the tolerance would test torch's rounding rather than the runtime.
"""
from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from stage_runtime_cases import Case, compare_cases_worker, make_units
from torch import nn

from mist_compiler.ir.plan import Offload
from mist_compiler.models import build_model
from mist_compiler.runtime.stage_runtime import AdamWConfig, StageRuntime, StageRuntimeError

TOLERANCE = 1e-5
WHOLE_BATCH_TOLERANCE = 1e-5


def _check(results) -> None:
    failures = [f"{label}: relative error {error:.3g} at {where} (whole-batch reference: {whole:.3g})"
                for label, error, where, whole in results
                if not (error <= TOLERANCE and whole <= WHOLE_BATCH_TOLERANCE)]
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_zero_levels_and_offload_match_adamw_on_2_ranks():
    half = 0.5
    cases = [
        Case(zero=0), Case(zero=1), Case(zero=2), Case(zero=3),
        Case(zero=0, offload=Offload(weights=half)),
        Case(zero=3, offload=Offload(weights=half)),
        Case(zero=1, offload=Offload(grads=half)),
        Case(zero=2, offload=Offload(grads=half)),
        Case(zero=0, offload=Offload(opt=half)),
        Case(zero=3, offload=Offload(opt=half)),
        Case(zero=1, offload=Offload(acts=half)),
        Case(zero=3, offload=Offload(weights=0.3, grads=0.7, opt=0.6, acts=0.5), model="llama-tiny"),
        Case(zero=1, offload=Offload(weights=0.5, opt=0.25), grad_accum=1, model="llama-tiny"),
        Case(zero=2, offload=Offload(weights=1.0, grads=1.0, opt=1.0, acts=1.0), tied=True, transform=True),
        # GPipe order (all forwards, then all backwards), checkpoint recompute, tied weights under ZeRO-3
        Case(zero=3, offload=Offload(weights=0.5, grads=0.5, opt=0.5, acts=0.5), schedule="gpipe"),
        Case(zero=3, tied=True, schedule="gpipe", checkpoint=True),
        Case(zero=2, offload=Offload(weights=0.5), checkpoint=True, reduce_scatter_fallback=True),
    ]
    results = run_ranks(compare_cases_worker, world=2, args=(cases, 3, 8), timeout_s=200)
    for rank_results in results:
        _check(rank_results)


@pytest.mark.distributed
def test_zero3_with_every_offload_kind_matches_adamw_on_4_ranks():
    cases = [
        Case(zero=3, offload=Offload(weights=0.5, grads=0.5, opt=0.25, acts=0.5), model="llama-tiny"),
    ]
    results = run_ranks(compare_cases_worker, world=4, args=(cases, 3, 8), timeout_s=200)
    for rank_results in results:
        _check(rank_results)


def test_bf16_compute_with_fp32_master_is_the_same_for_every_zero_level_and_offload():
    from stage_runtime_cases import make_batches, max_relative_error, reference_training, train_with_runtime

    adamw = AdamWConfig(lr=1e-3)
    batches = make_batches(2, 4, 16, 512)
    reference = reference_training("gpt-tiny", batches, adamw)
    results = []
    for case in (Case(zero=0, param_dtype=torch.bfloat16),
                 Case(zero=3, param_dtype=torch.bfloat16, offload=Offload(weights=0.5, grads=0.5, opt=0.5, acts=0.5))):
        weights, memory = train_with_runtime(0, 1, case, batches, adamw)
        assert all(w.dtype == torch.bfloat16 for w in weights.values())
        results.append({k: v.float() for k, v in weights.items()})
        error, where = max_relative_error(results[-1], reference)
        assert error < 2e-2, (case.label, error, where)  # bf16 rounding of the compute weights
    assert max_relative_error(results[0], results[1])[0] == 0.0


def _units():
    return make_units(build_model("gpt-tiny", seed=0))


@pytest.mark.parametrize("kwargs, message", [
    ({"zero": 4}, "zero must be 0, 1, 2 or 3"),
    ({"param_dtype": torch.int8}, "param_dtype"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"offload": {"pre": None}}, "offload table lacks"),
    ({"offload": "half"}, "offload must be"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    args = dict(dp_group=None, zero=0, offload=Offload(), optimizer=AdamWConfig(), device=torch.device("cpu"))
    args.update(kwargs)
    with pytest.raises(StageRuntimeError, match=message):
        StageRuntime(_units(), **args)


def test_bad_units_and_names_are_rejected():
    args = dict(dp_group=None, zero=0, offload=Offload(), optimizer=AdamWConfig(), device=torch.device("cpu"))
    with pytest.raises(StageRuntimeError, match="non-empty"):
        StageRuntime([], **args)
    with pytest.raises(StageRuntimeError, match="repeats the unit name"):
        StageRuntime([("a", nn.Linear(2, 2)), ("a", nn.Linear(2, 2))], **args)
    runtime = StageRuntime([("a", nn.Linear(2, 2))], **args)
    with pytest.raises(StageRuntimeError, match="unknown parameter 'a.nope'"):
        runtime.register_grad_transform("a.nope", lambda g: None)
    with pytest.raises(StageRuntimeError, match="unknown unit"):
        runtime.activation_offload("b")
    with pytest.raises(ValueError, match="AdamWConfig.lr"):
        AdamWConfig(lr=-1.0)


@pytest.mark.distributed
@pytest.mark.exclusive  # times the timeout
def test_a_missing_rank_gives_a_timeout_error_naming_unit_and_collective():
    from stage_runtime_cases import timeout_worker

    rank0, rank1 = run_ranks(timeout_worker, world=2, timeout_s=90)
    assert rank1 == "skipped"
    seconds, message = rank0.split(" ", 1)
    assert "all_gather of unit 'pre' weights" in message and "2 s" in message, message
    assert float(seconds[:-1]) < 10.0


def test_state_dict_round_trip_resumes_training_exactly():
    from stage_runtime_cases import _forward, make_batches, reference_name, train_with_runtime

    adamw = AdamWConfig(lr=1e-3, weight_decay=0.1)
    batches = make_batches(2, 2, 16, 512)
    case = Case(zero=3, grad_accum=1, offload=Offload(weights=0.5, opt=0.5))

    def make_runtime():
        units = make_units(build_model("gpt-tiny", seed=1))  # different init: load_state_dict must overwrite it
        return units, StageRuntime(units, dp_group=None, zero=3, offload=case.offload, optimizer=adamw,
                                   device=torch.device("cpu"))

    def train_step(units, runtime, batch):
        runtime.begin_iteration()
        runtime.set_last_microbatch(True)
        _forward(runtime, units, batch[0], batch[1], case).backward()
        runtime.step()

    uninterrupted, _ = train_with_runtime(0, 1, case, batches, adamw)
    units, first = make_runtime()
    first.load_state_dict(_state_of_build(adamw, case))
    train_step(units, first, batches[0])
    saved = first.state_dict()
    units, second = make_runtime()
    second.load_state_dict(saved)
    train_step(units, second, batches[1])
    resumed = {reference_name(k): v for k, v in second.named_full_parameters().items()}
    for name, value in uninterrupted.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0)
    with pytest.raises(StageRuntimeError, match="lacks unit"):
        second.load_state_dict({"step": 1, "units": {}})


def _state_of_build(adamw: AdamWConfig, case: Case) -> dict:
    """The state of a fresh runtime over the seed-0 model (what train_with_runtime starts from)."""
    runtime = StageRuntime(make_units(build_model("gpt-tiny", seed=0)), dp_group=None, zero=case.zero,
                           offload=case.offload, optimizer=adamw, device=torch.device("cpu"))
    return runtime.state_dict()


def test_zero3_prefetches_one_unit_ahead_and_frees_after_use():
    from stage_runtime_cases import _forward

    units = make_units(build_model("gpt-tiny", seed=0))
    units = units[:2] + units[-1:]  # pre, blocks.0, post
    runtime = StageRuntime(units, dp_group=None, zero=3, offload=Offload(), optimizer=AdamWConfig(),
                           device=torch.device("cpu"))
    trace = runtime.trace_events()
    runtime.begin_iteration()
    runtime.set_last_microbatch(True)
    ids = torch.randint(0, 512, (2, 8))
    _forward(runtime, units, ids, ids, Case(zero=3, grad_accum=1)).backward()
    runtime.step()
    # "forward"/"backward" are recorded when the unit starts computing, with its weights resident
    assert trace == [
        ("fetch", "pre"), ("forward", "pre"), ("fetch", "blocks.0"), ("free", "pre"),
        ("forward", "blocks.0"), ("fetch", "post"), ("free", "blocks.0"),
        ("forward", "post"), ("free", "post"),
        ("fetch", "post"), ("backward", "post"), ("fetch", "blocks.0"), ("reduce", "post"), ("free", "post"),
        ("backward", "blocks.0"), ("fetch", "pre"), ("reduce", "blocks.0"), ("free", "blocks.0"),
        ("backward", "pre"), ("reduce", "pre"), ("free", "pre"),
    ]
    assert all(not b.full.allocated for b in runtime.buckets)


def test_zero_grad_by_the_caller_does_not_break_the_buckets():
    from stage_runtime_cases import _forward, make_batches, max_relative_error, reference_training, train_with_runtime

    adamw = AdamWConfig(lr=1e-4, weight_decay=0.1)
    batches = make_batches(2, 2, 16, 512)
    case = Case(zero=2, grad_accum=1)
    expected, _ = train_with_runtime(0, 1, case, batches, adamw)
    units = make_units(build_model("gpt-tiny", seed=0))
    runtime = StageRuntime(units, dp_group=None, zero=2, offload=Offload(), optimizer=adamw, device=torch.device("cpu"))
    for input_ids, labels in batches:
        for _, module in units:
            module.zero_grad(set_to_none=True)
        runtime.begin_iteration()
        runtime.set_last_microbatch(True)
        _forward(runtime, units, input_ids, labels, case).backward()
        runtime.step()
    got = {k.split(".", 1)[1] if k.startswith(("pre.", "post.")) else k: v
           for k, v in runtime.named_full_parameters().items()}
    assert max_relative_error(got, expected)[0] == 0.0
