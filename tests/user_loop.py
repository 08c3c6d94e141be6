"""The user's own training loop under ``torch.compile(model, backend="mist")``, as typed, in a fresh process.

:func:`run_user_loop` runs one script (no package import before the compiled training: dynamo finds the
backend through its entry point) that trains the model three ways: compiled, eagerly, and eagerly
with each batch accumulated in two halves (the same step up to rounding: the noise ``--check`` compares
against). It returns the script's JSON: ``worst`` (compiled against eager: losses and the final
``state_dict()``), ``noise`` (halves against eager), both runs' losses and the route the backend took
(``"graph"``: the program cut from dynamo's graph, else what ``captured_from`` says).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_LOOP = textwrap.dedent("""
    import json, sys, torch
    {setup}
    options = json.loads(sys.argv[1])
    torch.manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (4, 16)), torch.randint(0, VOCAB, (4, 16))) for _ in range(3)]

    def train(compiled_backend, halves=False):
        model = build()
        run = torch.compile(model, backend="mist", {compile_args}options=options) if compiled_backend else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        losses = []
        for ids, labels in batches:
            if halves:  # the same step, the batch accumulated in two halves: differs only in rounding
                loss = 0.0
                for i, l in zip(ids.chunk(2), labels.chunk(2)):
                    out = model(input_ids=i, labels=l)
                    half = (out.loss if hasattr(out, "loss") else out) / 2
                    half.backward()
                    loss += half.detach()
            else:
                out = run(input_ids=ids, labels=labels)
                loss = out.loss if hasattr(out, "loss") else out
                loss.backward()
            opt.step(); sched.step(); opt.zero_grad()
            losses.append(float(loss))
        return losses, {{k: v.double() for k, v in model.state_dict().items()}}

    def distance(a, b):
        worst = max(abs(x - y) / abs(y) for x, y in zip(a[0], b[0]))
        for name, value in b[1].items():
            worst = max(worst, float((a[1][name] - value).norm() / value.norm().clamp(min=1e-12)))
        return worst

    compiled = train(True)
    from mist_compiler.torch_compile import plan_runtime
    route = plan_runtime._trainings[-1].captured_from
    eager, halves = train(False), train(False, halves=True)
    print(json.dumps({{"worst": distance(compiled, eager), "noise": distance(halves, eager),
                       "losses": compiled[0], "eager": eager[0], "route": route}}))
""")

FUSED_GPT = "from tests.user_models import fused_gpt\nVOCAB = 96\ndef build():\n    torch.manual_seed(1)\n    return fused_gpt()\n"


def run_user_loop(options: dict, setup: str = FUSED_GPT, cwd=None, dynamic: bool = False) -> dict:
    """The loop's JSON line (module docstring). ``setup`` defines ``VOCAB`` and ``build()``;
    ``dynamic``: ``torch.compile(..., dynamic=True)``."""
    script = USER_LOOP.format(setup=setup, compile_args="dynamic=True, " if dynamic else "")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script, json.dumps(options)], capture_output=True, text=True,
                            timeout=600, cwd=str(cwd) if cwd else None, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def gpt2_setup(folder) -> str:
    """A setup building a small Hugging Face GPT-2 from a config written into ``folder`` (no dropout:
    compared with eager torch)."""
    return textwrap.dedent(f"""
        from tests.hf_configs import write_config
        from mist_compiler.models import build_model
        SPEC = write_config("gpt2", {str(folder)!r}, dropout=False)
        VOCAB = 128
        def build():
            return build_model(SPEC)
    """)


def write_gpt2_plan(folder) -> str:
    """A one-stage plan for :func:`gpt2_setup`'s model whose micro-batch (2) is not the user's batch (4),
    with ZeRO-1 and one checkpointed layer; returns the plan file's path."""
    plan = {"model": "gpt2", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 2,
            "stages": [{"layers": [0, 3], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1,
                        "zero": 1, "ckpt_layers": 1}]}
    path = os.path.join(str(folder), "plan.json")
    with open(path, "w") as handle:
        json.dump(plan, handle)
    return path
