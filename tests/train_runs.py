"""Training jobs run on local gloo ranks for the trainer tests (module level: spawned ranks import it)."""
from __future__ import annotations

from mist_compiler.verify.check import NOISE_FACTOR, ULPS

SEQ = 16


def stage(layers, dp=1, tp=1, zero=0, **extra) -> dict:
    return {"layers": list(layers), "nodes": 1, "gpus_per_node": dp * tp, "micro_batch": None, "dp": dp, "tp": tp,
            "zero": zero, **extra}


def plan(stages: list[dict], global_batch: int = 8, grad_accum: int = 1, model: str = "gpt-tiny") -> dict:
    for s in stages:
        s["micro_batch"] = global_batch // (grad_accum * s["dp"])
    return {"model": model, "seq_len": SEQ, "global_batch": global_batch, "dtype": "float32",
            "grad_accum": grad_accum, "stages": stages}


def run_jobs(rank: int, world: int, jobs: list[tuple[dict, dict]]) -> list[dict]:
    """Each job: (plan, TrainConfig dict) trained to the end; per job the losses and norms (every rank)."""
    from mist_compiler.training.trainer import TrainConfig, Trainer

    results = []
    for plan_dict, config in jobs:
        trainer = Trainer(plan_dict["model"], plan_dict, TrainConfig.from_dict({"timeout_s": 60, **config}),
                          say=lambda line: None)
        start = trainer.step
        rows = trainer.fit()
        trainer.close()
        results.append({"start": start, "loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
                        "lr": [r["lr"] for r in rows]})
    return results


def reference_first_norm(model: str, plan_dict: dict) -> float:
    """One process, float64: the gradient norm of step 1's global batch (what clipping must see)."""
    import torch

    from mist_compiler.frontend.joint import model_call_kwargs
    from mist_compiler.models import build_model
    from mist_compiler.training.data import SAMPLE_TEXT, TokenSampler, open_tokens
    from mist_compiler.verify.check import loss_of

    module = build_model(model, seq_len=plan_dict["seq_len"]).double()
    batch = TokenSampler(open_tokens(SAMPLE_TEXT), plan_dict["global_batch"], plan_dict["seq_len"]).batch(0)
    loss_of(module(**batch, **model_call_kwargs(module))).backward()
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in module.parameters() if p.grad is not None)))


def assert_within_check_tolerance(got: list[float], want: list[float], noisy: list[float]) -> None:
    """``--check``'s rule for losses: within NOISE_FACTOR x the measured difference of two correct runs."""
    import torch

    noise = max(abs(n - w) / abs(w) for n, w in zip(noisy, want))
    allowed = max(NOISE_FACTOR * noise, ULPS * torch.finfo(torch.float32).eps)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= allowed, f"resumed losses differ by {worst:.2e} (allowed {allowed:.2e}): {got} vs {want}"
