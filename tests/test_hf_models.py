"""Hugging Face models are first-class: the matrix of current families (``tests/hf_configs.py``).

For every family (those outside ``IN_CI`` marked heavy), on two gloo ranks and one capture per rank
(:mod:`tests.family_runs`): the tuner plans it for two devices (tensor parallelism on offer), and a
data-parallel, a tensor-parallel and a pipeline plan train like one process (``--check``'s
comparison, dropout included). A plan may be refused only for a reason listed in ``REFUSED`` (and
in the README). The heavy sweep trains four ranks with ZeRO-3, offloading, checkpointing and a
tensor-parallel stage, and the mixture-of-experts families in fp16 and bf16.
"""
from __future__ import annotations

import pytest

from mist_compiler.launch.local_ranks import run_ranks
from tests.family_runs import family_plans, run_family
from tests.hf_configs import ARCHITECTURES, IN_CI, MOE, write_config
from tests.plan_runs import assert_all_pass, plan_dict, run_plans, stage

pytest.importorskip("transformers")

REFUSED: dict[tuple[str, str], str] = {}  # (family, plan) -> the reason a refusal must give (README lists them)
OFFLOAD = {"weights": 0.5, "grads": 0.0, "opt": 0.5, "acts": 0.5}


def _judge(kind: str, outcome: dict, names) -> None:
    for name in names:
        result = outcome[name]
        if (kind, name) in REFUSED:
            assert REFUSED[kind, name] in result.get("refused", ""), result
        else:
            assert result["ok"], f"{kind} {name}: {result.get('refused') or result['line']}"


def _in_ci_or_heavy(kinds) -> list:
    """Each family as a parameter; those outside ``IN_CI`` heavy (about 20 s each on two cores)."""
    return [pytest.param(kind, marks=() if kind in IN_CI else pytest.mark.heavy) for kind in sorted(kinds)]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", _in_ci_or_heavy(ARCHITECTURES))
def test_family_tunes_and_trains_dp_tp_pp_like_one_process(kind, tmp_path):
    model = write_config(kind, str(tmp_path / kind))
    outcome = run_ranks(run_family, world=2, args=(model, family_plans(model), True, 2), timeout_s=900)[0]
    tuned = outcome["tune"]
    assert tuned["world"] == 2 and tuned["layers"] == 3
    assert tuned["tp"] and tuned["tp_granularity"] >= 2, tuned["reason"]  # TP is on offer for all of them
    _judge(kind, outcome, ("dp", "tp", "pp"))


def four_rank_plans(model: str) -> list[dict]:
    return [
        plan_dict(model, 8, 2, [stage((0, 1), dp=2, zero=3, ckpt_layers=1, offload=OFFLOAD),
                                stage((1, 3), tp=2, zero=1)]),
        plan_dict(model, 8, 4, [stage((0, 1), dp=2, zero=2), stage((1, 2)), stage((2, 3), ckpt_layers=1)]),
    ]


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_family_trains_mixed_four_rank_plans_like_one_process(kind, tmp_path):
    model = write_config(kind, str(tmp_path / kind))
    assert_all_pass(run_plans(4, four_rank_plans(model), timeout_s=900))


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", sorted(MOE))
def test_mixture_of_experts_trains_in_half_precision_with_zero(kind, dtype, tmp_path):
    model = write_config(kind, str(tmp_path / kind))
    plans = family_plans(model, dtype=dtype, zero=2)
    outcome = run_ranks(run_family, world=2, args=(model, plans, False, 2), timeout_s=900)[0]
    _judge(kind, outcome, plans)
