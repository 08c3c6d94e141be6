"""``--check``: is a plan's training the same as one-process training, up to rounding?

What is compared, against one-process training of the same model on the same batches
(:func:`reference_run`, fp32 master weights, ``torch.optim.AdamW`` with the engine's settings):
the first step's gradients per tensor (after the plan's reductions, before the optimizer: the
place where a plan that sums instead of averaging, drops a micro-batch or feeds a stage the wrong
one shows at once), the loss of every step, and the final weights per tensor.

How close is close enough is *measured*, not assumed. The reference runs in float64, so it is
exact for this purpose; a second one-process run (:func:`noise_run`) computes in the plan's dtype
(fp32 master weights), so its distance to the reference is the rounding error of one ordinary
run of this model, in this dtype, over these steps -- including what Adam makes of it where
gradients are near zero (a 1e-7 change can flip the sign of a bias update, TORCH-NOTES section
9). A correct plan rounds differently but no worse: a quantity passes when the plan's distance to
the reference is within ``NOISE_FACTOR`` times the measured one -- of that quantity, or of all
quantities of its kind taken together, whichever is larger (one run's error on a single small
tensor is itself noisy), and never below a few units in the last place of the dtype. A plan that sums gradients
instead of averaging them, drops a micro-batch or feeds a stage the wrong one is off by orders
of magnitude more. Distances are relative Frobenius norms.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..ir.vocabulary import TORCH_DTYPES

NOISE_FACTOR = 10.0  # plans reorder more sums than one run does (TP splits inner products, DP splits batches)
ULPS = 16  # the smallest allowance: 16 x the dtype's machine epsilon (a scalar loss can round that far)
REFERENCE_DTYPES = {**TORCH_DTYPES, "float64": torch.float64}  # what a reference or noise run computes in
FP16_LOSS_SCALE = 1024.0


@dataclass
class Run:
    """What one training run produced: every step's loss, the first step's gradients, the final weights."""

    losses: list[float]
    gradients: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


@dataclass
class Verdict:
    ok: bool
    worst_ratio: float  # largest distance / allowed distance
    where: str
    distance: float
    allowed: float
    details: list[str] = field(default_factory=list)

    def line(self) -> str:
        verdict = "OK" if self.ok else "FAIL"
        return (f"check: {verdict}: largest difference {self.distance:.2e} at {self.where}, allowed {self.allowed:.2e} "
                f"({NOISE_FACTOR:g} x the rounding error of a one-process run, measured against float64)")


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (a whole tensor's relative error)."""
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).norm()) / max(float(b64.norm()), 1e-30)


def synthetic_batch(vocab: int, global_batch: int, seq_len: int, step: int, seed: int = 1234) -> dict[str, torch.Tensor]:
    """A deterministic batch of random token ids (labels are a fresh random draw)."""
    generator = torch.Generator().manual_seed(seed + step)
    input_ids = torch.randint(0, vocab, (global_batch, seq_len), generator=generator)
    labels = torch.randint(0, vocab, (global_batch, seq_len), generator=generator)
    return {"input_ids": input_ids, "labels": labels}


def loss_of(output: Any) -> torch.Tensor:
    return output.loss if hasattr(output, "loss") else output


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name of every parameter -> its first name (tied weights have several)."""
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names[name] = first.setdefault(id(param), name)
    return names


def _train(build: Callable[[], nn.Module], batches: list[dict], optimizer: dict, dtype: str, chunks: int,
           reverse: bool, call_kwargs: dict, master_dtype: str = "float32") -> Run:
    model = build().to(REFERENCE_DTYPES[master_dtype])
    masters = dict(model.named_parameters())
    compute = model if dtype == master_dtype else copy.deepcopy(model).to(REFERENCE_DTYPES[dtype])
    compute_params = dict(compute.named_parameters())
    scale = FP16_LOSS_SCALE if dtype == "float16" else 1.0
    opt = torch.optim.AdamW(list(masters.values()), **optimizer)
    losses, first_gradients = [], {}
    for step, batch in enumerate(batches):
        if compute is not model:
            with torch.no_grad():
                for name, param in compute_params.items():
                    param.copy_(masters[name])
        pieces = [{k: v.chunk(chunks)[i] for k, v in batch.items()} for i in range(chunks)]
        total = 0.0
        for piece in (reversed(pieces) if reverse else pieces):
            loss = loss_of(compute(**piece, **call_kwargs)).to(REFERENCE_DTYPES[master_dtype]) / chunks
            (loss * scale).backward()
            total += float(loss.detach())
        for name, master in masters.items():
            grad = compute_params[name].grad
            master.grad = None if grad is None else grad.to(master.dtype) / scale
        if step == 0:
            first_gradients = {n: p.grad.detach().clone() for n, p in masters.items() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        compute.zero_grad(set_to_none=True)
        losses.append(total)
    return Run(losses, first_gradients, {n: p.detach().clone() for n, p in masters.items()})


def reference_run(build, batches, optimizer: dict, call_kwargs: dict | None = None) -> Run:
    """One process, float64 throughout, the whole global batch at once: what every plan approximates."""
    return _train(build, batches, optimizer, "float64", 1, False, call_kwargs or {}, master_dtype="float64")


def noise_run(build, batches, optimizer: dict, dtype: str, chunks: int, call_kwargs: dict | None = None) -> Run:
    """One ordinary process run in ``dtype`` (fp32 masters): its distance to the reference is the
    rounding error the plan is allowed (times ``NOISE_FACTOR``)."""
    return _train(build, batches, optimizer, dtype, max(chunks, 1), False, call_kwargs or {})


def _pooled(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], names: dict[str, str]) -> float:
    """Relative distance of all tensors of a kind taken together."""
    pairs = [(got[n].double().flatten(), want[names.get(n, n)].double().flatten()) for n in got
             if names.get(n, n) in want and got[n].shape == want[names.get(n, n)].shape]
    if not pairs:
        return 0.0
    return relative_difference(torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs]))


def compare(plan_run: Run, reference: Run, noise: Run, names: dict[str, str], dtype: str) -> Verdict:
    """The plan's run against the reference, each quantity bounded by its measured noise."""
    floor = ULPS * torch.finfo(TORCH_DTYPES[dtype]).eps
    worst = Verdict(True, 0.0, "-", 0.0, floor)
    missing = sorted(set(names.values()) - {names.get(n, n) for n in plan_run.weights})
    if missing:
        return Verdict(False, float("inf"), f"parameters missing from the run: {missing[:5]}", float("inf"), floor)
    no_gradient = sorted(set(reference.gradients) - {names.get(n, n) for n in plan_run.gradients})
    if plan_run.gradients and no_gradient:
        return Verdict(False, float("inf"), f"parameters the plan gave no gradient: {no_gradient[:5]}",
                       float("inf"), floor)

    def consider(where: str, got, want, noisy, pooled: float) -> None:
        nonlocal worst
        if isinstance(got, float):
            distance = abs(got - want) / max(abs(want), 1e-12)
            noise_level = abs(noisy - want) / max(abs(want), 1e-12)
        elif got.shape != want.shape:
            distance, noise_level = float("inf"), 0.0
        else:
            distance, noise_level = relative_difference(got, want), relative_difference(noisy, want)
        allowed = max(NOISE_FACTOR * max(noise_level, pooled), floor)
        ratio = distance / allowed
        if ratio > worst.worst_ratio:
            worst = Verdict(ratio <= 1.0, ratio, where, distance, allowed)

    loss_noise = max((abs(n - w) / max(abs(w), 1e-12) for n, w in zip(noise.losses, reference.losses)), default=0.0)
    for step, (got, want, noisy) in enumerate(zip(plan_run.losses, reference.losses, noise.losses)):
        consider(f"the loss of step {step + 1}", got, want, noisy, loss_noise)
    for kind, got_all, want_all, noisy_all in (("gradient", plan_run.gradients, reference.gradients, noise.gradients),
                                                ("final weight", plan_run.weights, reference.weights, noise.weights)):
        pooled = _pooled(noisy_all, want_all, {})
        for name, got in got_all.items():
            key = names.get(name, name)
            if key in want_all:
                consider(f"the {kind} of {key}", got, want_all[key], noisy_all[key], pooled)
    return worst


def vocab_size(model) -> int:
    """The token vocabulary of a model (an ``nn.Module``: its config or largest embedding; a captured
    program: the embedding its input ids index)."""
    graph = getattr(model, "model_graph", None)
    if graph is not None:
        from .tp_check import _vocabulary

        return _vocabulary(graph)
    config = getattr(model, "config", None)
    for attr in ("vocab", "vocab_size"):
        if config is not None and isinstance(getattr(config, attr, None), int):
            return getattr(config, attr)
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError(f"cannot find the vocabulary size of {type(model).__name__}")
    return max(e.num_embeddings for e in embeddings)


def check_run(model_name: str, plan, batches: list[dict], run: Run, optimizer) -> Verdict:
    """``--check`` for a finished run of ``plan`` on ``batches`` (call on the rank that gathered it)."""
    from ..frontend.joint import model_call_kwargs
    from ..models import build_model

    build = lambda: build_model(model_name, seq_len=plan.seq_len)  # noqa: E731
    probe = build()
    kwargs = model_call_kwargs(probe)
    settings = optimizer if isinstance(optimizer, dict) else {
        "lr": optimizer.lr, "betas": tuple(optimizer.betas), "eps": optimizer.eps, "weight_decay": optimizer.weight_decay}
    reference = reference_run(build, batches, settings, kwargs)
    noise = noise_run(build, batches, settings, plan.dtype, plan.grad_accum, kwargs)
    return compare(run, reference, noise, canonical_names(probe), plan.dtype)
