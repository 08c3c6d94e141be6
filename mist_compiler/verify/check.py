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
9); three such runs are made (:func:`noise_runs`: the batch summed in different orders) and the
largest error counts. A correct plan rounds differently but no worse: a quantity passes when the plan's distance to
the reference is within ``NOISE_FACTOR`` times the measured one -- of that quantity, or of all
quantities of its kind and rank taken together (the vectors: biases and norms; the matrices),
whichever is larger (one run's error on a single small tensor is itself noisy), and never below a
few units in the last place of the dtype; a final weight also passes within ``UPDATE_FLOOR`` of
the optimizer's steps per element (a bias that started at zero is all updates: where part of its
gradient is rounding noise, as the attention norm bias of OPT whose key-side share is zero,
every valid order of sums moves it differently at that scale). A plan that sums gradients
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
from ..ops.dropout import sample_seeds
from .dropout_reference import DropoutReference

NOISE_FACTOR = 10.0  # plans reorder more sums than one run does (TP splits inner products, DP splits batches)
ULPS = 16  # the smallest allowance: 16 x the dtype's machine epsilon (a scalar loss can round that far)
UPDATE_FLOOR = 1e-4  # a final weight may differ by this fraction of the optimizer's steps (lr x steps) per element
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
    model = with_eager_experts(build()).to(REFERENCE_DTYPES[master_dtype])
    masters = dict(model.named_parameters())
    compute = model if dtype == master_dtype else copy.deepcopy(model).to(REFERENCE_DTYPES[dtype])
    compute_params = dict(compute.named_parameters())
    scale = FP16_LOSS_SCALE if dtype == "float16" else 1.0
    opt = torch.optim.AdamW(list(masters.values()), **optimizer)
    dropout = DropoutReference(compute)  # the masks the plan draws (ops.dropout), numbered as capture does
    losses, first_gradients = [], {}
    for step, batch in enumerate(batches):
        if compute is not model:
            with torch.no_grad():
                for name, param in compute_params.items():
                    param.copy_(masters[name])
        samples = torch.arange(next(iter(batch.values())).shape[0]).chunk(chunks)
        pieces = [({k: v.chunk(chunks)[i] for k, v in batch.items()}, samples[i]) for i in range(chunks)]
        total = 0.0
        for piece, rows in (reversed(pieces) if reverse else pieces):
            with dropout.drawing(sample_seeds(0, step, rows)):
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


def with_eager_experts(model: nn.Module) -> nn.Module:
    """A Hugging Face mixture-of-experts model runs its experts as written (a loop over experts):
    its default ``grouped_mm`` kernel has no float64 version, so the reference could not run."""
    config = getattr(model, "config", None)
    if callable(getattr(model, "set_experts_implementation", None)) and \
            getattr(config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")
    return model


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


def compare(plan_run: Run, reference: Run, noise: Run | list[Run], names: dict[str, str], dtype: str,
            update_floor: float = 0.0) -> Verdict:
    """The plan's run against the reference, each quantity bounded by its measured noise (the largest
    over the noise runs given: one run's error is itself a noisy estimate); a final weight may also
    differ by ``update_floor`` per element (absolute: a tiny fraction of what the optimizer moves it)."""
    noises = noise if isinstance(noise, list) else [noise]
    floor = ULPS * torch.finfo(TORCH_DTYPES[dtype]).eps
    worst = Verdict(True, 0.0, "-", 0.0, floor)
    missing = sorted(set(names.values()) - {names.get(n, n) for n in plan_run.weights})
    if missing:
        return Verdict(False, float("inf"), f"parameters missing from the run: {missing[:5]}", float("inf"), floor)
    no_gradient = sorted(set(reference.gradients) - {names.get(n, n) for n in plan_run.gradients})
    if plan_run.gradients and no_gradient:
        return Verdict(False, float("inf"), f"parameters the plan gave no gradient: {no_gradient[:5]}",
                       float("inf"), floor)

    def distance(got, want) -> float:
        if isinstance(got, float):
            return abs(got - want) / max(abs(want), 1e-12)
        return relative_difference(got, want) if got.shape == want.shape else float("inf")

    ratios: list[tuple[float, str]] = []

    def consider(where: str, got, want, noisy: list, pooled: float, absolute: float = 0.0) -> None:
        nonlocal worst
        measured = distance(got, want)
        noise_level = max(distance(n, want) for n in noisy) if measured != float("inf") else 0.0
        allowed = max(NOISE_FACTOR * max(noise_level, pooled), floor)
        if absolute and not isinstance(want, float):
            allowed = max(allowed, absolute * want.numel() ** 0.5 / max(float(want.double().norm()), 1e-30))
        ratio = measured / allowed
        ratios.append((ratio, where))
        if ratio > worst.worst_ratio:
            worst = Verdict(ratio <= 1.0, ratio, where, measured, allowed)

    loss_noise = max((distance(n, w) for run in noises for n, w in zip(run.losses, reference.losses)), default=0.0)
    for step, (got, want) in enumerate(zip(plan_run.losses, reference.losses)):
        consider(f"the loss of step {step + 1}", got, want, [run.losses[step] for run in noises], loss_noise)
    for kind in ("gradients", "weights"):
        got_all, want_all = getattr(plan_run, kind), getattr(reference, kind)
        pooled = {rank: max(_pooled({n: t for n, t in getattr(run, kind).items() if t.dim() == rank}, want_all, {})
                            for run in noises) for rank in {t.dim() for t in want_all.values()}}
        label = "gradient" if kind == "gradients" else "final weight"
        for name, got in got_all.items():
            key = names.get(name, name)
            if key in want_all:
                consider(f"the {label} of {key}", got, want_all[key], [getattr(run, kind)[key] for run in noises],
                         pooled[want_all[key].dim()], update_floor if kind == "weights" else 0.0)
    worst.details = [f"{where}: {ratio:.2f} of the allowance" for ratio, where in sorted(ratios, reverse=True)[:5]]
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
    # Adam moves an element by about lr a step, near-zero gradients included: rounding-level gradient
    # differences there become update differences (TORCH-NOTES section 9); 1e-4 of a step is below them
    floor = UPDATE_FLOOR * settings["lr"] * len(batches)
    return compare(run, reference, noise_runs(build, batches, settings, plan, kwargs), canonical_names(probe),
                   plan.dtype, update_floor=floor)


def noise_runs(build, batches: list[dict], settings: dict, plan, kwargs: dict) -> list[Run]:
    """Ordinary one-process runs summing the batch in different orders: as the plan's micro-batches,
    the same in reverse, and in twice as many pieces (or as many as the plan's micro-batches times
    its data-parallel ranks): one run's error on a tensor whose gradient is partly rounding noise
    (OPT's attention norm bias: softmax ignores what it adds to every key) is itself a noisy
    estimate, so the largest of three counts."""
    chunks = max(plan.grad_accum, 1)
    more = max(2 * chunks, plan.grad_accum * max(stage.dp for stage in plan.stages))
    runs = [noise_run(build, batches, settings, plan.dtype, chunks, kwargs),
            _train(build, batches, settings, plan.dtype, chunks, True, kwargs)]
    if plan.global_batch % more == 0:
        runs.append(noise_run(build, batches, settings, plan.dtype, more, kwargs))
    return runs
