"""torch.compile(model, backend="mist", options=...): the user's loop unchanged trains like eager.

Each test runs the literal user loop in a fresh subprocess (no package import first: dynamo finds
the backend through its entry point), against the same loop run eagerly, and compares every
loss and the final ``model.state_dict()`` with ``--check``'s noise-based comparison.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

USER_LOOP = textwrap.dedent("""
    import json, sys, torch
    from tests.user_models import fused_gpt
    {model_setup}
    options = json.loads(sys.argv[1])
    torch.manual_seed(0)
    batches = [(torch.randint(0, VOCAB, (4, 16)), torch.randint(0, VOCAB, (4, 16))) for _ in range(3)]

    def train(compiled_backend, halves=False):
        model = build()
        run = torch.compile(model, backend="mist", options=options) if compiled_backend else model
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

    compiled, eager, halves = train(True), train(False), train(False, halves=True)
    print(json.dumps({{"worst": distance(compiled, eager), "noise": distance(halves, eager),
                       "losses": compiled[0], "eager": eager[0]}}))
""")

FACTORY = "VOCAB = 96\ndef build():\n    torch.manual_seed(1)\n    return fused_gpt()\n"


def run_loop(options: dict, model_setup: str = FACTORY, tmp_path=None) -> dict:
    script = USER_LOOP.format(model_setup=model_setup)
    result = subprocess.run([sys.executable, "-c", script, json.dumps(options)], capture_output=True, text=True,
                            timeout=600, cwd=str(tmp_path) if tmp_path else None,
                            env={**__import__("os").environ, "PYTHONPATH": _roots()})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _roots() -> str:
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])


def test_torch_compile_tunes_then_trains_the_users_module_with_the_users_optimizer():
    """Options name the cluster, not a plan: the backend tunes, then trains. The user's AdamW at
    lr 1e-2 with a decaying schedule is what trains (not a default), and state_dict() is the result."""
    result = run_loop({"hardware": "cpu", "nodes": 1, "gpus_per_node": 1, "global_batch": 4, "seq_len": 16,
                       "dtype": "float32"})
    assert result["worst"] <= max(10 * result["noise"], 1e-6), result  # within 10x rounding noise
    assert result["losses"][2] < result["losses"][0]  # it trained


def test_torch_compile_with_a_plan_and_hugging_face_outputs(tmp_path):
    """A Hugging Face GPT-2 (its loss logs a warning: a graph break unless logging is dropped),
    under a given plan, returning its output object."""
    pytest.importorskip("transformers")
    setup = textwrap.dedent(f"""
        from tests.hf_configs import write_config
        from mist_compiler.models import build_model
        SPEC = write_config("gpt2", {str(tmp_path / 'gpt2')!r}, dropout=False)  # compared with eager torch
        VOCAB = 128
        def build():
            return build_model(SPEC)
    """)
    plan = {"model": "gpt2", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 2,
            "stages": [{"layers": [0, 3], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1,
                        "zero": 1, "ckpt_layers": 1}]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    result = run_loop({"plan": str(path)}, setup, tmp_path)
    assert result["worst"] <= max(10 * result["noise"], 1e-6), result


def test_options_are_checked_and_named():
    from mist_compiler.torch_compile.plan_runtime import DynamoRuntimeError, parse_options

    with pytest.raises(DynamoRuntimeError, match=r"unknown option\(s\) \['zero_level'\]"):
        parse_options({"plan": "plan.json", "zero_level": 3})
    with pytest.raises(DynamoRuntimeError, match=r"\['global_batch', 'hardware'\] are needed to tune"):
        parse_options({"timeout_s": 3})
    with pytest.raises(DynamoRuntimeError, match="option 'nodes' must be an integer in 1.."):
        parse_options({"hardware": "cpu", "global_batch": 8, "nodes": 0})


def test_an_optimizer_the_plan_cannot_run_is_refused_in_one_line():
    import torch

    from mist_compiler.torch_compile.plan_runtime import DynamoRuntimeError, optimizer_settings

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_settings(torch.optim.AdamW(params, lr=0.5)).lr == 0.5
    assert optimizer_settings(torch.optim.Adam(params, lr=0.1)).weight_decay == 0.0
    with pytest.raises(DynamoRuntimeError, match="the plan runs AdamW; SGD cannot be run"):
        optimizer_settings(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(DynamoRuntimeError, match="L2, not decoupled"):
        optimizer_settings(torch.optim.Adam(params, lr=0.1, weight_decay=0.1))
