"""Shared pieces of the stage-runtime tests: a tiny model cut into units, reference training, a worker.

Kept out of the test modules so spawned ranks import it without importing pytest test files.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from mist_compiler.ir.plan import Offload
from mist_compiler.models import build_model
from mist_compiler.runtime.stage_runtime import AdamWConfig, StageRuntime


class Pre(nn.Module):
    """Embedding (+ learned positions) of a TransformerLM."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.embed = model.embed
        self.pos_embed = getattr(model, "pos_embed", None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(input_ids.shape[1]))
        return x


class Post(nn.Module):
    """Final norm, head and mean cross-entropy of a TransformerLM."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.final_norm = model.final_norm
        self.head = model.head

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.final_norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def make_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    units: list[tuple[str, nn.Module]] = [("pre", Pre(model))]
    units += [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
    units.append(("post", Post(model)))
    return units


def reference_name(unit_name: str) -> str:
    """Runtime parameter name -> the TransformerLM's own name."""
    for prefix in ("pre.", "post."):
        if unit_name.startswith(prefix):
            return unit_name[len(prefix):]
    return unit_name


def make_batches(steps: int, global_batch: int, seq: int, vocab: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (global_batch, seq), generator=generator),
         torch.randint(0, vocab, (global_batch, seq), generator=generator))
        for _ in range(steps)
    ]


def reference_training(model_name: str, batches, adamw: AdamWConfig, tied: bool = False,
                       pieces: int = 1) -> dict[str, torch.Tensor]:
    """Single-process torch.optim.AdamW on each whole global batch (its mean loss's gradient taken
    over ``pieces`` equal consecutive chunks, each loss divided by ``pieces``, when pieces > 1)."""
    model = build_model(model_name, seed=0)
    if tied:
        model.head.weight = model.embed.weight
    optimizer = torch.optim.AdamW(model.parameters(), lr=adamw.lr, betas=adamw.betas, eps=adamw.eps,
                                  weight_decay=adamw.weight_decay)
    for input_ids, labels in batches:
        optimizer.zero_grad()
        size = input_ids.shape[0] // pieces
        for piece in range(pieces):
            rows = slice(piece * size, (piece + 1) * size)
            (model(input_ids=input_ids[rows], labels=labels[rows]) / pieces).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@dataclass(frozen=True)
class Case:
    """One runtime configuration to train and compare against the reference."""

    zero: int
    offload: Offload = field(default_factory=Offload)
    grad_accum: int = 2
    model: str = "gpt-tiny"
    tied: bool = False
    param_dtype: torch.dtype = torch.float32
    schedule: str = "interleaved"  # "interleaved": F0 B0 F1 B1 ...; "gpipe": all forwards, then all backwards
    checkpoint: bool = False  # recompute each block in backward (torch.utils.checkpoint around the unit)
    reduce_scatter_fallback: bool = False  # force dist_compat's all_reduce + slice reduce-scatter
    transform: bool = False  # register an identity-preserving grad transform (x2 then /2 on one param)
    grad_dtype: torch.dtype = torch.float32  # ZeRO 0/1: gradients kept between micro-batches in this dtype

    @property
    def label(self) -> str:
        extras = [name for name, on in (("tied", self.tied), ("transform", self.transform), ("gpipe", self.schedule == "gpipe"),
                                         ("checkpoint", self.checkpoint), ("rs-fallback", self.reduce_scatter_fallback),
                                         ("low-precision-grads", self.grad_dtype != torch.float32)) if on]
        return f"{self.model} zero={self.zero} offload={self.offload} G={self.grad_accum} {' '.join(extras)}"


def _reduced_grad(bucket) -> torch.Tensor:
    """A bucket's reduced gradient over its master range, fp32 on the CPU (zeros where it got none)."""
    numel = bucket.opt_state.master.numel
    out = torch.zeros(numel, dtype=torch.float32)
    for window, part in bucket.reduced_grad_views(0, numel):
        out[window] = part.detach().float().cpu()
    return out


def train_with_runtime(rank: int, world: int, case: Case, batches, adamw: AdamWConfig,
                       grads_out: list | None = None) -> tuple[dict, dict]:
    """Train with a StageRuntime on this rank's share of every global batch; returns weights and memory
    (and appends each step's reduced fp32 gradient shards, unit by unit, to ``grads_out``)."""
    model = build_model(case.model, seed=0)
    if case.tied:
        model.head.weight = model.embed.weight
    units = make_units(model)
    runtime = StageRuntime(units, dp_group=dist.group.WORLD if world > 1 else None, zero=case.zero,
                           offload=case.offload, optimizer=adamw, device=torch.device("cpu"),
                           param_dtype=case.param_dtype, grad_dtype=case.grad_dtype)
    if case.transform:
        name = "blocks.0.attn.q.weight"
        runtime.register_grad_transform(name, lambda g: g.mul_(2.0))
        runtime.register_grad_transform(name, lambda g: g.mul_(0.5))
    if case.reduce_scatter_fallback:
        from mist_compiler.runtime import dist_compat

        dist_compat._reduce_scatter_native[str(dist.get_backend())] = False
    memory = {}
    for input_ids, labels in batches:
        per_rank = input_ids.shape[0] // world
        ids = input_ids[rank * per_rank:(rank + 1) * per_rank]
        lab = labels[rank * per_rank:(rank + 1) * per_rank]
        micro = per_rank // case.grad_accum
        runtime.begin_iteration()
        losses = []
        for m in range(case.grad_accum):
            losses.append(_forward(runtime, units, ids[m * micro:(m + 1) * micro], lab[m * micro:(m + 1) * micro],
                                   case))
            if case.schedule != "gpipe":
                runtime.set_last_microbatch(m == case.grad_accum - 1)
                losses.pop().backward()
        for m, loss in enumerate(losses):
            runtime.set_last_microbatch(m == case.grad_accum - 1)
            loss.backward()
        runtime.finish_gradients()
        memory = runtime.memory_report()
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for _, m in units for p in m.parameters()}
        memory["param_storage_bytes"] = sum(storages.values())
        memory["acts_offloaded"] = sum(o.offloaded_bytes for o in runtime.activations.values())
        memory["acts_kept"] = sum(o.kept_bytes for o in runtime.activations.values())
        if grads_out is not None:
            grads_out.append(torch.cat([_reduced_grad(b) for b in runtime.buckets]))
        runtime.step()
    weights = runtime.named_full_parameters()
    runtime.remove_hooks()
    return {reference_name(k): v for k, v in weights.items()}, memory


def _forward(runtime: StageRuntime, units, x: torch.Tensor, y: torch.Tensor, case: Case) -> torch.Tensor:
    """One micro-batch through the units; the loss scaled by 1/G as the pipeline engine does."""
    for name, module in units[:-1]:
        with runtime.activation_offload(name):
            if case.checkpoint and name.startswith("blocks."):
                x = torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False)
            else:
                x = module(x)
    with runtime.activation_offload("post"):
        return units[-1][1](x, y) / case.grad_accum


def max_relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    if set(got) != set(want):
        return float("inf"), f"names differ: {sorted(set(got) ^ set(want))}"
    worst, where = 0.0, ""
    for name, value in want.items():
        error = ((got[name] - value).norm() / value.norm().clamp_min(1e-12)).item()
        if error > worst:
            worst, where = error, name
    return worst, where


def compare_cases_worker(rank: int, world: int, cases: list[Case], steps: int, global_batch: int) -> list:
    """Spawned rank: train every case and compare it with single-process torch.optim.AdamW.

    Returns ``(label, error vs the same-chunking reference, where, error vs whole-batch reference)``.
    """
    # lr 1e-4: fp32 summation-order noise between two torch references stays ~2e-6 (at 1e-3 Adam's first
    # steps amplify it to ~6e-5), while every bug seen so far gave errors above 1e-3
    adamw = AdamWConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    results = []
    references: dict[tuple, dict] = {}
    for case in cases:
        cfg = build_model(case.model, seed=0).config
        batches = make_batches(steps, global_batch, 16, cfg.vocab)
        for pieces in (1, world * case.grad_accum):
            key = (case.model, case.tied, pieces)
            if key not in references:
                references[key] = reference_training(case.model, batches, adamw, tied=case.tied, pieces=pieces)
        got, _ = train_with_runtime(rank, world, case, batches, adamw)
        error, where = max_relative_error(got, references[(case.model, case.tied, world * case.grad_accum)])
        whole_error, _ = max_relative_error(got, references[(case.model, case.tied, 1)])
        results.append((case.label, error, where, whole_error))
    return results


def memory_worker(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Spawned rank: one training step per case; the memory report just before the optimizer step."""
    adamw = AdamWConfig()
    reports = []
    for case in cases:
        cfg = build_model(case.model, seed=0).config
        batches = make_batches(1, 4 * world, 16, cfg.vocab)
        _, memory = train_with_runtime(rank, world, case, batches, adamw)
        reports.append(memory)
    return reports


def timeout_worker(rank: int, world: int) -> str:
    """Rank 1 skips a ZeRO-3 all-gather: rank 0 must get a CollectiveError naming unit and collective."""
    import time

    from mist_compiler.runtime.dist_compat import CollectiveError

    model = build_model("gpt-tiny", seed=0)
    runtime = StageRuntime(make_units(model), dp_group=dist.group.WORLD, zero=3, offload=Offload(),
                           optimizer=AdamWConfig(), device=torch.device("cpu"), timeout_s=2.0)
    if rank == 1:
        time.sleep(3.5)
        return "skipped"
    start = time.monotonic()
    try:
        runtime.named_full_parameters()
    except CollectiveError as error:
        return f"{time.monotonic() - start:.1f}s {error}"
    return "no error"


def gpt_small_tied() -> nn.Module:
    """gpt-small with its head tied to the token embedding (a model spec: ``stage_runtime_cases:gpt_small_tied``)."""
    from dataclasses import replace

    from mist_compiler.models import TransformerLM, zoo_config

    return TransformerLM(replace(zoo_config("gpt-small"), tied_head=True))
