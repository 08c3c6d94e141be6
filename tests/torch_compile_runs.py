"""A user's loop under torchrun (``python -m torch.distributed.run -m tests.torch_compile_runs PLAN...``):
the same loop trained eagerly (whole batch, one process's arithmetic on every rank) and through
``torch.compile(backend="mist")`` under each named plan; rank 0 prints one JSON line comparing
every parameter after every step."""
from __future__ import annotations

import json
import os
import sys

import torch

from mist_compiler.ir.plan import Plan
from tests.user_models import VOCAB, fused_gpt

STAGE = {"nodes": 1, "gpus_per_node": 2, "micro_batch": 4, "dp": 1, "tp": 1, "zero": 0, "layers": [0, 3]}
PLANS = {
    "dp2": {"grad_accum": 2, "stages": [dict(STAGE, micro_batch=1, dp=2)]},  # whole parameters: the user's AdamW
    "zero1": {"grad_accum": 1, "stages": [dict(STAGE, micro_batch=2, dp=2, zero=1)]},
    "zero3": {"grad_accum": 2, "stages": [dict(STAGE, micro_batch=1, dp=2, zero=3)]},
    "tp2": {"grad_accum": 1, "stages": [dict(STAGE, tp=2)]},
    "pp2": {"grad_accum": 2, "stages": [dict(STAGE, gpus_per_node=1, micro_batch=2, layers=[0, 2]),
                                        dict(STAGE, gpus_per_node=1, micro_batch=2, layers=[2, 3])]},
}
DYNAMIC = os.environ.get("MIST_TEST_DYNAMIC") == "1"  # torch.compile(dynamic=True): the program cut from dynamo's graph
torch.manual_seed(0)
BATCHES = [(torch.randint(0, VOCAB, (4, 16)), torch.randint(0, VOCAB, (4, 16))) for _ in range(3)]


def train(plan: dict | None, halves: bool = False) -> tuple[list[dict], float, bool, str, str]:
    torch.manual_seed(1)
    model = fused_gpt()
    params = list(model.parameters())
    run = model
    if plan is not None:
        plan = Plan.from_dict({"model": "FusedGPT", "seq_len": 16, "global_batch": 4, "dtype": "float32", **plan})
        run = torch.compile(model, backend="mist", options={"plan": plan}, dynamic=DYNAMIC or None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    steps = []
    for ids, labels in BATCHES:
        if halves:
            for i, l in zip(ids.chunk(2), labels.chunk(2)):
                (model(input_ids=i, labels=l) / 2).backward()
        else:
            run(input_ids=ids, labels=labels).backward()
        model.trunk[0].fc.bias.grad.neg_()  # the user's own change to a gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step(); sched.step(); opt.zero_grad()
        steps.append({name: p.detach().clone() for name, p in model.named_parameters()})
    model.eval()
    with torch.no_grad():
        evaluated = float(run(input_ids=BATCHES[0][0], labels=BATCHES[0][1]))
    same = all(a is b for a, b in zip(params, model.parameters()))
    if plan is None:
        return steps, evaluated, same, "eager", "eager"
    from mist_compiler.torch_compile.plan_runtime import _trainings

    return steps, evaluated, same, type(_trainings[-1].parameters).__name__, _trainings[-1].captured_from


def distance(a: list[dict], b: list[dict]) -> float:
    return max(float((x[k] - y[k]).norm() / y[k].norm().clamp(min=1e-12)) for x, y in zip(a, b) for k in y)


def main(names: list[str]) -> None:
    eager, eager_eval, _, _, _ = train(None)
    noise = distance(train(None, halves=True)[0], eager)
    plans = {}
    for name in names:
        steps, evaluated, same, binding, route = train(PLANS[name])
        plans[name] = {"worst": distance(steps, eager), "eval": evaluated, "same": same, "binding": binding,
                       "route": route}
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"noise": noise, "eager_eval": eager_eval, "plans": plans}))


if __name__ == "__main__":
    main(sys.argv[1:])
