"""``Trainer``: real training of a model under a plan on this rank (what ``mistc train`` runs).

Per step: the global batch of the step (:mod:`.data`, the same under every plan), the engine's
forward and backward, the global gradient norm and clipping, the learning rate of the schedule and
decoupled weight decay by parameter group (:mod:`.optim`), the engine's AdamW update. Rank 0 prints
one line per logging interval and appends every step to the ``metrics`` JSONL file. Checkpoints
(:mod:`.checkpoint`) save every ``save_every`` steps and at the end; ``resume`` continues from one
(bit for bit under the same plan, correctly under another). Every rank must construct and ``fit``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..ir.plan import Plan, load_plan
from .checkpoint import Checkpointer, CheckpointError, checkpoint_group, load_state, read_meta, resolve
from .data import SAMPLE_TEXT, TokenSampler, open_tokens
from .optim import LRSchedule, OptimConfig, TrainingOptimizer


@dataclass
class TrainConfig:
    """Everything a training run needs besides the model and the plan (JSON-serialisable)."""

    steps: int
    data: str | None = None  # None: the sample text shipped with the package
    data_dtype: str | None = None
    tokenizer: str | None = None
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)
    log_every: int = 1
    metrics: str | None = None
    save_dir: str | None = None
    save_every: int = 0
    resume: str | None = None
    resume_exact: bool = False
    blocking_save: bool = False
    export: str | None = None
    peak_tflops: float | None = None  # per device, for MFU
    timeout_s: float = 300.0
    compile_units: bool = True  # False: the stage programs run eagerly (--no-compile, for debugging)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        optim = dict(data.get("optim") or {})
        if "betas" in optim:
            optim["betas"] = tuple(optim["betas"])
        return cls(**{**data, "optim": OptimConfig(**optim)})


def _rows_up_to(path: str, step: int) -> list[str]:
    """The lines of a metrics file up to ``step`` (those after it belong to the run being redone)."""
    if not os.path.isfile(path):
        return []
    with open(path) as handle:
        return [line for line in handle if line.strip() and json.loads(line).get("step", 0) <= step]


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class Trainer:
    """Train ``model`` (a name or module) under ``plan`` (a Plan or path) with ``config``."""

    def __init__(self, model: Any, plan: Plan | str | dict, config: TrainConfig,
                 say: Callable[[str], None] | None = None) -> None:
        from .. import driver

        if isinstance(plan, dict):
            plan = Plan.from_dict(plan)
        self.plan = load_plan(plan) if isinstance(plan, str) else plan
        self.config = config
        self.model_name = model if isinstance(model, str) else type(model).__name__
        self.say = say or (lambda line: print(f"mist: {line}", flush=True))
        started = time.perf_counter()
        compiled = driver.compile_model(model, plan=self.plan, model_name=model if isinstance(model, str) else None,
                                        prove=False, timeout_s=config.timeout_s, compile_units=config.compile_units)
        self.program, self.engine = compiled.program, compiled.engine
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        path = config.data or SAMPLE_TEXT
        self.sampler = TokenSampler(open_tokens(path, dtype=config.data_dtype, tokenizer=config.tokenizer),
                                    self.plan.global_batch, self.plan.seq_len, config.seed, path)
        from ..verify.check import vocab_size

        self.sampler.vocab = vocab_size(self.program)  # batch by batch: the launcher read the whole file already
        cfg = config.optim
        self.schedule = LRSchedule(cfg.lr, config.steps, cfg.warmup, cfg.min_lr)
        self.optimizer = TrainingOptimizer(self.engine, cfg)
        self.group = checkpoint_group(config.timeout_s) if config.save_dir or config.resume else None
        self.checkpointer = Checkpointer(self.engine, config.save_dir, self.group, config.blocking_save) \
            if config.save_dir else None
        self.step = 0
        if config.resume:
            self._resume(config.resume)
        self.flops_per_token = self._flops_per_token()
        if self.rank == 0:
            self.say(f"compiled {self.model_name} for {self.world} rank(s) in {time.perf_counter() - started:.1f} s"
                     + (f", resumed at step {self.step}" if self.step else ""))

    # ---- set-up helpers ---------------------------------------------------------------------------
    def _flops_per_token(self) -> float:
        """6 x parameters (forward and backward of every weight); 0 unless MFU was asked for."""
        if not self.config.peak_tflops:
            return 0.0
        from ..models import build_model

        with torch.device("meta"):
            module = build_model(self.model_name, seq_len=self.plan.seq_len, seed=None)
        return 6.0 * sum(p.numel() for p in module.parameters())

    def _resume(self, where: str) -> None:
        path = resolve(where)
        meta = read_meta(path)
        if meta.get("model") != self.model_name:
            raise CheckpointError(f"checkpoint {path!r} was saved for model {meta.get('model')!r}, "
                                  f"not {self.model_name!r}")
        same_plan = meta.get("plan") == self.plan.to_dict()
        if self.config.resume_exact and not same_plan:
            raise CheckpointError(f"--resume-exact: checkpoint {path!r} was saved under another plan "
                                  f"({meta.get('world')} ranks); bit-exact resumption needs the same plan")
        load_state(self.engine, self.optimizer.views, path, same_world=meta.get("world") == self.world,
                   group=self.group)
        self.step = int(meta["step"])
        self.engine.runtime.optimizer.step_count = int(meta["optimizer_steps"])
        scaler = self.engine.loss_scaler
        if scaler is not None and meta.get("loss_scaler"):
            scaler.scale = float(meta["loss_scaler"]["scale"])
            scaler.clean_steps = int(meta["loss_scaler"]["clean_steps"])
            scaler.skipped_steps = int(meta["loss_scaler"]["skipped_steps"])

    def _meta(self) -> dict:
        scaler = self.engine.loss_scaler
        return {"model": self.model_name, "plan": self.plan.to_dict(), "world": self.world,
                "optimizer_steps": self.engine.runtime.optimizer.step_count,
                "loss_scaler": None if scaler is None else {"scale": scaler.scale, "clean_steps": scaler.clean_steps,
                                                            "skipped_steps": scaler.skipped_steps},
                "config": self.config.to_dict(), "torch": torch.__version__}

    # ---- the loop ----------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One step; returns its metrics (the same on every rank)."""
        step = self.step + 1
        clock = time.perf_counter()
        loss = self.engine.forward_backward(self.sampler.batch(self.step))
        lr = self.schedule(step)
        norm = self.optimizer.step(lr)
        elapsed = time.perf_counter() - clock
        self.step = step
        tokens = self.plan.global_batch * self.plan.seq_len
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "tokens_per_s": tokens / elapsed,
               "step_time_s": elapsed, "peak_memory_bytes": _peak_memory_bytes(self.engine.device)}
        if self.config.peak_tflops:
            row["mfu"] = self.flops_per_token * tokens / elapsed / (self.config.peak_tflops * 1e12 * self.world)
        if self.engine.loss_scaler is not None:
            row["loss_scale"] = self.engine.loss_scaler.scale
        return row

    def fit(self) -> list[dict]:
        """Train up to ``config.steps`` (total, also when resumed); returns the metrics of this call's steps."""
        cfg = self.config
        rows: list[dict] = []
        metrics = None
        if cfg.metrics and self.rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics)), exist_ok=True)
            kept = _rows_up_to(cfg.metrics, self.step) if self.step else []  # a resumed run redoes later steps
            metrics = open(cfg.metrics, "w")
            metrics.writelines(kept)
        try:
            while self.step < cfg.steps:
                row = self.train_step()
                rows.append(row)
                if self.checkpointer is not None and (
                        (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps):
                    row["save_stall_s"] = self.checkpointer.save(self.step, self._meta()).stage_s
                if self.rank == 0:
                    if metrics is not None:
                        metrics.write(json.dumps(row) + "\n")
                        metrics.flush()
                    if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                        self.say(self._line(row))
                    if len(rows) == 1:  # units compile at their first call
                        self.say(f"compilation: {self.engine.compile_stats.describe()}")
            if self.checkpointer is not None:
                self.checkpointer.wait()
        finally:
            if metrics is not None:
                metrics.close()
        if cfg.export:
            self.export(cfg.export)
        return rows

    def _line(self, row: dict) -> str:
        text = (f"step {row['step']}/{self.config.steps}: loss {row['loss']:.6f}, lr {row['lr']:.2e}, "
                f"grad norm {row['grad_norm']:.4f}, {row['tokens_per_s']:,.0f} tokens/s, "
                f"peak memory {row['peak_memory_bytes'] / 2**20:,.0f} MiB")
        if "mfu" in row:
            text += f", MFU {100 * row['mfu']:.1f}%"
        return text

    def export(self, path: str) -> None:
        """The whole model's fp32 weights, named as in the model, written by rank 0: ``*.safetensors``
        (when safetensors is installed), a directory for ``save_pretrained`` (Hugging Face models),
        else ``torch.save`` (load with ``torch.load(path, weights_only=True)``). Collective."""
        state = self.engine.gather_full_state(dst=0)
        if self.rank != 0:
            return
        from .export import write_export

        write_export(state, path, self.model_name, self.plan.seq_len)
        self.say(f"exported {len(state)} tensors to {path}")

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()
        self.engine.close()
