"""``torch.compile(model, backend="mist")`` trains the user's module itself: after every step
``model.parameters()`` are the trained tensors (the same objects), with ``.grad`` after every call;
the user's optimizer (any, in one process), clipping, scheduler, ``model.eval()`` and
``torch.no_grad()`` behave as in eager, in one process and under torchrun with sharded plans; the
plan's dtype follows the model (or an autocast region). Each loop runs as a user types it, in a
fresh process, next to the same loop run eagerly."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.dist_utils import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}

ONE_PROCESS = textwrap.dedent("""
    import json, sys, torch, transformers
    from tests.pretrained_models import save_tiny_llama, VOCAB
    save_tiny_llama("base")
    torch.manual_seed(0)
    batches = [torch.randint(0, VOCAB, (4, 16)) for _ in range(3)]
    options = {"hardware": "cpu", "global_batch": 4, "seq_len": 16}

    def train(compiled, halves=False):
        model = transformers.AutoModelForCausalLM.from_pretrained("base")
        model.train()
        params = list(model.parameters())
        run = torch.compile(model, backend="mist", options=options) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)  # not what the engine runs itself
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        steps = []
        for ids in batches:
            if halves:  # the same step in two halves: differs from eager by rounding only
                for part in ids.chunk(2):
                    (model(input_ids=part, labels=part).loss / 2).backward()
            else:
                run(input_ids=ids, labels=ids).loss.backward()
            grad = model.model.norm.weight.grad.clone()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step(); sched.step(); opt.zero_grad()
            steps.append({"grad": grad, "norm_weight": model.model.norm.weight.detach().clone(),
                          "same": all(a is b for a, b in zip(params, model.parameters()))})
        model.eval()
        with torch.no_grad():
            logits = run(input_ids=batches[0]).logits
        model.train()
        with torch.no_grad():
            held_out = float(run(input_ids=batches[1], labels=batches[1]).loss)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        return steps, logits, held_out, state, model

    def distance(a, b):
        return float((a - b).norm() / b.norm().clamp(min=1e-12))

    (c, c_logits, c_val, c_state, model), (e, e_logits, e_val, e_state, _) = train(True), train(False)
    h = train(False, halves=True)
    from mist_compiler.torch_compile import plan_runtime
    training = plan_runtime._trainings[-1]
    worst = max(max(distance(x["grad"], y["grad"]), distance(x["norm_weight"], y["norm_weight"])) for x, y in zip(c, e))
    noise = max(max(distance(x["grad"], y["grad"]), distance(x["norm_weight"], y["norm_weight"])) for x, y in zip(h[0], e))
    worst_state = max(distance(c_state[k], e_state[k]) for k in e_state)
    noise_state = max(distance(h[3][k], e_state[k]) for k in e_state)

    autocast_model = transformers.AutoModelForCausalLM.from_pretrained("base")
    before = autocast_model.model.norm.weight.detach().clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(autocast_model, backend="mist", options=options)(input_ids=batches[0], labels=batches[0])
    out.loss.backward()
    torch.optim.SGD(autocast_model.parameters(), lr=0.5).step()
    print(json.dumps({
        "dtype": training.engine.plan.dtype, "binding": type(training.parameters).__name__,
        "same": all(x["same"] for x in c), "worst": worst, "noise": noise,
        "worst_state": worst_state, "noise_state": noise_state,
        "logits": distance(c_logits, e_logits), "logits_shape": list(c_logits.shape),
        "held_out": [c_val, e_val], "state_is_parameters": all(p is not None and torch.equal(p, c_state[n])
                                                               for n, p in model.named_parameters()),
        "autocast_dtype": plan_runtime._trainings[-1].engine.plan.dtype,
        "autocast_params": str(autocast_model.model.norm.weight.dtype),
        "autocast_trained": not torch.equal(before, autocast_model.model.norm.weight.detach())}))
""")


def test_one_process_the_users_optimizer_trains_the_users_parameters(tmp_path):
    result = subprocess.run([sys.executable, "-c", ONE_PROCESS], capture_output=True, text=True, timeout=900,
                            cwd=str(tmp_path), env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["dtype"] == "float32" and out["binding"] == "AliasedParameters", out  # an fp32 model trains in fp32
    assert out["same"] and out["state_is_parameters"], out
    assert out["worst"] <= max(10 * out["noise"], 1e-6), out  # .grad and trained weights, step by step
    assert out["worst_state"] <= max(10 * out["noise_state"], 1e-6), out
    assert out["logits_shape"] == [4, 16, 256] and out["logits"] <= 1e-6, out  # eval: the model's own forward
    assert out["held_out"][0] == pytest.approx(out["held_out"][1], rel=1e-5), out  # no_grad: a forward, no step
    assert out["autocast_dtype"] == "bfloat16" and out["autocast_params"] == "torch.float32", out
    assert out["autocast_trained"], out


@pytest.mark.distributed
def test_under_torchrun_sharded_plans_keep_the_users_parameters_live(tmp_path):
    """Data parallelism (the parameters are the masters), ZeRO-1 (dp 2), tensor parallelism (tp 2) and
    a pipeline (pp 2, head tied to the embedding across the stages) under the user's AdamW, clipping,
    a gradient the user changes itself and a scheduler: every rank's model.parameters() follow eager
    training step by step."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "tests.torch_compile_runs",
                             "dp2", "zero1", "tp2", "pp2"], capture_output=True, text=True, timeout=900, cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["plans"]["dp2"]["binding"] == "AliasedParameters", out
    assert {row["binding"] for name, row in out["plans"].items() if name != "dp2"} == {"MirroredParameters"}, out
    for plan, row in out["plans"].items():
        assert row["same"], (plan, row)
        assert row["route"] == "graph", (plan, row)  # the static graph, traced again by dynamo with symbolic sizes
        assert row["worst"] <= max(10 * out["noise"], 1e-6), (plan, row, out["noise"])
        assert row["eval"] == pytest.approx(out["eager_eval"], rel=1e-5), (plan, row)
