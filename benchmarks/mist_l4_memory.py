"""Mist's published L4 plans: our predicted per-stage peak memory against what Mist measured.

Every plan Mist ran on L4 GPUs and published a measurement for (its EuroSys 25 artifact,
github.com/Dazz993/Mist, commit d69e530):

- the base case of its README (``README.md``, "Step 2.4: Exec the small case"): GPT-1.3B on 2 L4,
  DP 2, micro-batch 8, ZeRO-1, every layer checkpointed, no flash attention; "Allocated memories:
  [19273.83] MB" (also FACTS.md, "Mist's own base case"; ``benchmarks/plans/mist-base-case.json``);
- the nine single-node plans its tuner found for the L4 cluster
  (``benchmark/mist/tuned_configs/l4-24gb/{gpt,llama}/*.yaml``: ``strategy.layer_partitions``,
  ``device_assignment``, ``gradient_checkpointing``, ``gradient_accumulation_steps`` and
  ``stage_strategies`` = [micro-batch, DP, TP, ZeRO-3, ZeRO-2, ZeRO-1, weight/grad/optimizer/activation
  offload ratios], as ``mist/config.py`` reads them), with the peaks its runtime measured per
  stage (``.../l4-24gb/{gpt,llama}/expected_summary.json``, ``exec_stage_peak_allocated_memories``).
  ``f_True`` plans use flash attention, ``f_False`` plans the math kernel (``model.use_flash_attn``).

Mist's "MB" is ``torch.cuda.max_memory_allocated() / 2**20`` (``mist/utils/common.py``:
``MB = 1024**2``; ``benchmark_func_walltime`` divides by it): mebibytes. They are converted to bytes
here before comparing (our ``mistc analyze`` prints 1e6-byte MB).

All plans: fp16 weights, fp16 gradients kept between micro-batches (Mist's runtime: its flat fp16
gradient buffers; ``grad_dtype: float16`` in our plan), fp32 AdamW states sharded over DP (ZeRO-1),
sequence 2048, vocabulary 50304, 1F1B pipelines. Mist's LLaMA applies rotary embeddings to a quarter
of each head (``rotary_emb_fraction: 0.25``), ours to all of it: the same tensors are saved.

Prediction: ``mist_compiler.cost.analyze.analyze`` of the plan on the ``l4`` profile (``--eager`` prices
the eager program: what autograd saves op by op; default: the compiled program our runtime runs).

Usage: ``PYTHONPATH=. python benchmarks/mist_l4_memory.py [--eager]``
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache

from mist_compiler.driver import capture as capture_program
from mist_compiler.cost.analyze import analyze
from mist_compiler.cost.hardware import load_profile
from mist_compiler.cost.stage_model import build_stage_cost_model
from mist_compiler.ir.plan import Offload, Plan, StagePlan

MIB = 2 ** 20
SEQ = 2048
REPOSITORY = "github.com/Dazz993/Mist@d69e530"
TUNED = "benchmark/mist/tuned_configs/l4-24gb"


@dataclass(frozen=True)
class MistStage:
    """One stage of a Mist plan: ``layer_partitions[i]``, ``device_assignment[i]`` (one node),
    ``gradient_checkpointing[i]`` and ``stage_strategies[i]`` (micro-batch, DP, offload ratios)."""

    layers: int
    gpus: int
    micro_batch: int
    dp: int
    ckpt: int
    offload_opt: float = 0.0
    offload_acts: float = 0.0


@dataclass(frozen=True)
class MistPlan:
    name: str
    model: str
    global_batch: int
    grad_accum: int
    attention: str  # "flash" (use_flash_attn: true) or "math"
    stages: tuple[MistStage, ...]
    measured_mib: tuple[float, ...]  # per stage, Mist's runtime
    source: str  # where the plan and its measurement are published

    def plan(self, compiled: bool = True) -> Plan:
        built, start = [], 0
        for stage in self.stages:
            built.append(StagePlan(layers=(start, start + stage.layers), nodes=1, gpus_per_node=stage.gpus,
                                   micro_batch=stage.micro_batch, dp=stage.dp, tp=1, zero=1, ckpt_layers=stage.ckpt,
                                   offload=Offload(opt=stage.offload_opt, acts=stage.offload_acts)))
            start += stage.layers
        return Plan(self.model, SEQ, self.global_batch, "float16", self.grad_accum, tuple(built), "float16", compiled)


def _tuned(family: str, key: str) -> str:
    return f"{REPOSITORY} {TUNED}/{family}/{key}.yaml + {TUNED}/{family}/expected_summary.json[{key!r}]"


S = MistStage
PLANS: tuple[MistPlan, ...] = (
    MistPlan("gpt2-1.3b base case (README)", "gpt2-1.3b", 32, 2, "math", (S(24, 2, 8, 2, 24),), (19273.83,),
             f"{REPOSITORY} README.md, Step 2.4 'Allocated memories: [19273.83] MB'; FACTS.md"),
    MistPlan("gpt2-1.3b math", "gpt2-1.3b", 32, 32, "math", (S(13, 1, 1, 1, 0), S(11, 1, 1, 1, 0)),
             (18506, 13406), _tuned("gpt", "1.3b-s_2048-v_50304-b_32-n_1-m_2-f_False")),
    MistPlan("gpt2-1.3b flash", "gpt2-1.3b", 32, 16, "flash", (S(13, 1, 2, 1, 0), S(11, 1, 2, 1, 0)),
             (18357, 13696), _tuned("gpt", "1.3b-s_2048-v_50304-b_32-n_1-m_2-f_True")),
    MistPlan("gpt2-2.7b math", "gpt2-2.7b", 64, 64, "math",
             (S(7, 1, 1, 1, 2), S(8, 1, 1, 1, 1), S(9, 1, 1, 1, 0), S(8, 1, 1, 1, 0)),
             (19757, 19365, 18871, 15681), _tuned("gpt", "2.7b-s_2048-v_50304-b_64-n_1-m_4-f_False")),
    MistPlan("gpt2-2.7b flash", "gpt2-2.7b", 64, 32, "flash", (S(17, 2, 1, 2, 0), S(15, 2, 1, 2, 0)),
             (19607, 15414), _tuned("gpt", "2.7b-s_2048-v_50304-b_64-n_1-m_4-f_True")),
    MistPlan("gpt2-7b math", "gpt2-7b", 128, 64, "math",
             (S(7, 2, 1, 2, 5, 0.125), S(8, 2, 1, 2, 1, 0.875), S(9, 2, 1, 2, 0, 0.875), S(8, 2, 1, 2, 0, 0.375)),
             (20033, 19329, 18145, 19061), _tuned("gpt", "7b-s_2048-v_50304-b_128-n_1-m_8-f_False")),
    MistPlan("gpt2-7b flash", "gpt2-7b", 128, 64, "flash",
             (S(7, 2, 1, 2, 3), S(8, 2, 1, 2, 2, 0.125), S(9, 2, 1, 2, 0, 0.375), S(8, 2, 1, 2, 0)),
             (20534, 19767, 18582, 20216), _tuned("gpt", "7b-s_2048-v_50304-b_128-n_1-m_8-f_True")),
    MistPlan("llama-1.3b flash", "llama-1.3b", 32, 16, "flash", (S(13, 1, 2, 1, 0), S(11, 1, 2, 1, 0)),
             (18678, 13916), _tuned("llama", "1.3b-s_2048-v_50304-b_32-n_1-m_2-f_True")),
    MistPlan("llama-2.7b flash", "llama-2.7b", 64, 32, "flash", (S(17, 2, 1, 2, 0), S(15, 2, 1, 2, 0)),
             (19821, 15569), _tuned("llama", "2.7b-s_2048-v_50304-b_64-n_1-m_4-f_True")),
    MistPlan("llama-7b flash", "llama-7b", 128, 64, "flash",
             (S(7, 2, 1, 2, 4), S(8, 2, 1, 2, 3), S(9, 2, 1, 2, 0, 0.375), S(8, 2, 1, 2, 0)),
             (19670, 20311, 18685, 20310), _tuned("llama", "7b-s_2048-v_50304-b_128-n_1-m_8-f_True")),
)


@dataclass
class Row:
    plan: str
    stage: int
    predicted: float  # bytes
    measured: float  # bytes
    fits: bool

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


@lru_cache(maxsize=None)
def _program(model: str):
    """The model captured once per process (every plan of a model, compiled or eager, prices the same capture)."""
    return capture_program(model, seq_len=SEQ, dtype="float16")


def compare(plans=PLANS, *, compiled: bool = True, hardware: str = "l4") -> list[Row]:
    profile = load_profile(hardware)
    models: dict[tuple[str, str], object] = {}
    rows = []
    for mist in plans:
        key = (mist.model, mist.attention)
        if key not in models:
            models[key] = build_stage_cost_model(_program(mist.model), profile, seq_len=SEQ, dtype="float16",
                                                 attention=mist.attention, grad_dtype="float16",
                                                 compiled=compiled)
        estimate = analyze(_program(mist.model), mist.plan(compiled), profile, attention=mist.attention, cost_model=models[key])
        for index, (stage, measured) in enumerate(zip(estimate.stages, mist.measured_mib)):
            rows.append(Row(mist.name, index, stage.peak_memory_mb * 1e6, measured * MIB, stage.fits))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="price the eager program (autograd's saved tensors)")
    args = parser.parse_args(argv)
    rows = compare(compiled=not args.eager)
    print(f"{'plan':<30} {'stage':>5} {'predicted MiB':>14} {'Mist MiB':>10} {'error':>8}  fits in an L4")
    for row in rows:
        print(f"{row.plan:<30} {row.stage:>5} {row.predicted / MIB:>14,.0f} {row.measured / MIB:>10,.0f} "
              f"{row.error:>+8.1%}  {'yes' if row.fits else 'NO'}")
    errors = [abs(row.error) for row in rows]
    plans_not_fitting = sorted({row.plan for row in rows if not row.fits})
    print(f"\n{len(rows)} stages of {len(PLANS)} plans: mean |error| {statistics.mean(errors):.1%}, "
          f"worst {max(errors):.1%}; plans that do not fit: {len(plans_not_fitting)}"
          + (f" ({', '.join(plans_not_fitting)})" if plans_not_fitting else ""))
    for family in ("gpt2", "llama"):
        chosen = [row.error for row in rows if row.plan.startswith(family)]
        print(f"  {family}: mean error {statistics.mean(chosen):+.1%}, range {min(chosen):+.1%} .. {max(chosen):+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
