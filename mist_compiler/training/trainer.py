"""``Trainer``: real training of a model under a plan on this rank (what ``mistc train`` runs).

Per step: the global batch of the step (:mod:`.data`, the same under every plan), the engine's
forward and backward, the global gradient norm and clipping, the learning rate of the schedule and
decoupled weight decay by parameter group (:mod:`.optim`), the engine's AdamW update. Rank 0 prints
one line per logging interval (with elapsed time and ETA) and appends every step to the
``metrics`` JSONL file (:mod:`.metrics`). Checkpoints (:mod:`.checkpoint`) save every ``save_every``
steps and at the end; ``resume`` continues from one (bit for bit under the same plan, correctly
under another) after checking its files (:mod:`.integrity`). Every rank must construct and ``fit``.

What a long job meets: a step whose loss or gradient norm is not finite updates nothing, and
``max_bad_steps`` of them in a row end the run (:class:`DivergenceError`); SIGTERM/SIGINT finish
the step, save, and raise :class:`.preemption.Preempted`; a failed background save stops every rank
at the next step with its cause. The save directory belongs to one run (:mod:`.save_dir`).
"""
from __future__ import annotations

import dataclasses
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..frontend.labels import label_convention
from ..ir.plan import Plan, load_plan
from .checkpoint import Checkpointer, checkpoint_group, load_state
from .data import SAMPLE_TEXT, TokenSampler, open_tokens
from .integrity import BackgroundVerification, CheckpointError, check_manifest, nonfinite_keys
from .metrics import MetricsLog
from .optim import LRSchedule, OptimConfig, StepOutcome, TrainingOptimizer
from .preemption import Preempted, StopRequest
from .save_dir import (RunLock, check_ownership, clear_checkpoints, complete_steps, held_by, latest_name, read_meta,
                       resolve)


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
    timeout_s: float = 120.0
    max_bad_steps: int = 3  # consecutive steps with a non-finite loss or gradient norm before the run stops
    keep_last: int = 0  # checkpoints kept in save_dir (0: all)
    overwrite: bool = False  # start over in a save_dir that holds checkpoints (deletes them)
    lock_token: str | None = None  # the launcher holds save_dir's lock under this token
    compile_units: bool | None = None  # None: as the plan says; False: eager units (--no-compile, for debugging)

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("max_bad_steps", 1), ("keep_last", 0), ("save_every", 0), ("log_every", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TrainConfig.{name} must be an integer >= {low}, got {value!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        optim = dict(data.get("optim") or {})
        if "betas" in optim:
            optim["betas"] = tuple(optim["betas"])
        return cls(**{**data, "optim": OptimConfig(**optim)})


class DivergenceError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm."""


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size, also before the process group exists (torchrun's env)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _start_resume(where: str) -> tuple[str, dict, BackgroundVerification]:
    """The checkpoint ``where`` names, its mist.json (and manifest) checked, and this rank's share of
    the data-file checks running in the background while the model compiles."""
    path = resolve(where)
    meta = read_meta(path)
    check_manifest(path, meta)
    return path, meta, BackgroundVerification(path, meta, *_rank_and_world())


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
        self.model = model  # a name or the user's module (the export rebuilds it, it does not change it)
        self.model_name = model if isinstance(model, str) else type(model).__name__
        self.say = say or (lambda line: print(f"mist: {line}", flush=True))
        started = time.perf_counter()
        self.lock = self._own_save_dir()
        resuming = _start_resume(config.resume) if config.resume else None
        compiled = driver.compile_model(model, plan=self.plan, model_name=model if isinstance(model, str) else None,
                                        prove=False, timeout_s=config.timeout_s, compile_units=config.compile_units)
        self.program, self.engine = compiled.program, compiled.engine
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        path = config.data or SAMPLE_TEXT
        self.labels = label_convention(self.program)  # the model's own: do not shift what it shifts itself
        self.sampler = TokenSampler(open_tokens(path, dtype=config.data_dtype, tokenizer=config.tokenizer),
                                    self.plan.global_batch, self.plan.seq_len, config.seed, path,
                                    shift_labels=not self.labels.shifted_inside)
        from ..verify.check import vocab_size

        self.sampler.vocab = vocab_size(self.program)  # batch by batch: the launcher read the whole file already
        cfg = config.optim
        self.schedule = LRSchedule(cfg.lr, config.steps, cfg.warmup, cfg.min_lr)
        self.optimizer = TrainingOptimizer(self.engine, cfg)
        self.group = checkpoint_group(config.timeout_s) if config.save_dir or config.resume else None
        self.checkpointer = Checkpointer(self.engine, config.save_dir, self.group, config.blocking_save,
                                         keep_last=config.keep_last, say=self.say) if config.save_dir else None
        self.step = 0
        self.resumed_from: str | None = None
        if resuming is not None:
            self._resume(*resuming)
        self.flops_per_token = self._flops_per_token()
        if self.rank == 0:
            self.say(f"compiled {self.model_name} for {self.world} rank(s) in {time.perf_counter() - started:.1f} s"
                     + (f", resumed at step {self.step}" if self.step else ""))

    # ---- set-up helpers ---------------------------------------------------------------------------
    def _own_save_dir(self) -> RunLock | None:
        """Rank 0 of a run started from Python (not by ``mistc train``, whose launcher did this before
        any rank started): take save_dir's lock and refuse to overwrite another run's checkpoints."""
        cfg = self.config
        if not cfg.save_dir or _rank_and_world()[0] != 0 or held_by(cfg.save_dir, cfg.lock_token):
            return None
        lock = RunLock.acquire(cfg.save_dir)
        try:
            check_ownership(cfg.save_dir, cfg.resume, cfg.overwrite)
            if cfg.overwrite:
                clear_checkpoints(cfg.save_dir)
        except BaseException:
            lock.release()
            raise
        return lock

    def _flops_per_token(self) -> float:
        """Training FLOPs per token (:mod:`mist_compiler.cost.flops`, the tuner's formula); 0 unless MFU
        was asked for."""
        if not self.config.peak_tflops:
            return 0.0
        from ..cost.flops import flops_per_token
        from ..driver import ir_shape

        return flops_per_token(ir_shape(self.program), self.plan.seq_len) or 0.0

    def _resume(self, path: str, meta: dict, verification: BackgroundVerification) -> None:
        mine = verification.problems()
        problems: list[list[str]] = [mine]
        if self.group is not None:
            problems = [[] for _ in range(self.world)]
            dist.all_gather_object(problems, mine, group=self.group)
        found = [problem for share in problems for problem in share]
        if found:
            earlier = [name for step, name in complete_steps(os.path.dirname(path)) if step < int(meta["step"])]
            hint = f"; resume from an earlier one (--resume {os.path.join(os.path.dirname(path), earlier[-1])})" \
                if earlier else ""
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise CheckpointError(f"checkpoint {path} is damaged: {found[0]}{more}{hint}")
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
        self.resumed_from = path
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
    def train_step(self, stop_requested: bool = False) -> dict:
        """One step; returns its metrics (the same on every rank). ``row["stop"]``: some rank asked to
        stop; ``row["skipped"]``: nothing was updated (``row["diverged"]``: the loss or norm was not finite)."""
        step = self.step + 1
        clock = time.perf_counter()
        loss = self.engine.forward_backward(self.sampler.batch(self.step))
        lr = self.schedule(step)
        failed_save = self.checkpointer is not None and self.checkpointer.failed()
        outcome: StepOutcome = self.optimizer.step(lr, loss, stop_requested or failed_save)
        elapsed = time.perf_counter() - clock
        self.step = step
        tokens = self.plan.global_batch * self.plan.seq_len
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": outcome.grad_norm, "tokens_per_s": tokens / elapsed,
               "step_time_s": elapsed, "peak_memory_bytes": _peak_memory_bytes(self.engine.device)}
        if self.config.peak_tflops:
            row["mfu"] = self.flops_per_token * tokens / elapsed / (self.config.peak_tflops * 1e12 * self.world)
        if self.engine.loss_scaler is not None:
            row["loss_scale"] = self.engine.loss_scaler.scale
        if outcome.skipped:
            row["skipped"] = True
        if outcome.diverged:
            row["diverged"] = True
        row["stop"] = outcome.stop
        return row

    def fit(self, stop: StopRequest | None = None) -> list[dict]:
        """Train up to ``config.steps`` (total, also when resumed); returns the metrics of this call's steps.
        Raises :class:`DivergenceError`, :class:`.preemption.Preempted` or ``CheckpointError`` (a failed save).
        SIGTERM/SIGINT are handled during the call (or by ``stop``, installed earlier by the caller)."""
        cfg = self.config
        rows: list[dict] = []
        metrics = MetricsLog(cfg.metrics) if cfg.metrics and self.rank == 0 else None
        own_stop = stop is None
        stop = StopRequest().install() if stop is None else stop
        self._started, self._first_step = time.perf_counter(), self.step
        bad: list[dict] = []
        try:
            while self.step < cfg.steps:
                row = self.train_step(stop.requested)
                rows.append(row)
                bad = bad + [row] if row.get("diverged") else []
                stopping = row["stop"] and self.step < cfg.steps
                if stopping and self.checkpointer is not None:
                    self.checkpointer.wait()  # a save in flight completes first (a failed one ends the run here)
                due = (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps
                if self.checkpointer is not None and due and not bad and not stopping:
                    row["save_stall_s"] = self.checkpointer.save(self.step, self._meta()).stage_s
                if self.rank == 0:
                    if metrics is not None:
                        metrics.write({k: v for k, v in row.items() if k != "stop"})
                    if self.step % cfg.log_every == 0 or self.step == cfg.steps or bad or stopping:
                        self.say(self._line(row, len(bad), stopping))
                    if len(rows) == 1:  # units compile at their first call
                        self.say(f"compilation: {self.engine.compile_stats.describe()}")
                if len(bad) >= cfg.max_bad_steps:
                    if self.checkpointer is not None:
                        self.checkpointer.wait()  # the last good step's save completes: the message names it
                    raise DivergenceError(self._divergence(bad))
                if stopping:
                    self._preempt(stop.signal_name or "a signal to another rank")
            if self.checkpointer is not None:
                self.checkpointer.wait()
        finally:
            if own_stop:
                stop.restore()
            if metrics is not None:
                metrics.close()
        if cfg.export:
            self.export(cfg.export)
        return rows

    def _preempt(self, signal_name: str) -> None:
        """Save the step just finished (synchronously; a save in flight completes first), then stop."""
        path = None
        if self.checkpointer is not None:
            timings = self.checkpointer.timings
            if not timings or timings[-1].step != self.step:
                self.checkpointer.save(self.step, self._meta())
            self.checkpointer.wait()
            path = os.path.join(self.config.save_dir, f"step-{self.step:06d}")
        raise Preempted(self.step, signal_name, path)

    def _divergence(self, bad: list[dict]) -> str:
        last = bad[-1]
        where = f"step {last['step']}" if len(bad) == 1 else f"steps {bad[0]['step']}-{last['step']}"
        latest = latest_name(self.config.save_dir) if self.config.save_dir else None
        tail = f"; the last checkpoint is {os.path.join(self.config.save_dir, latest)}" if latest else ""
        return (f"training diverged: {where} ({len(bad)} in a row, --max-bad-steps {self.config.max_bad_steps}) had a "
                f"non-finite loss or gradient norm (loss {last['loss']}, grad norm {last['grad_norm']}); they did not "
                f"update the weights{tail}. Lower --lr or --clip, then --resume")

    def _line(self, row: dict, bad_in_a_row: int = 0, stopping: bool = False) -> str:
        done = self.step - self._first_step
        elapsed = time.perf_counter() - self._started
        eta = elapsed / done * (self.config.steps - self.step) if done else 0.0
        text = (f"step {row['step']}/{self.config.steps}: loss {row['loss']:.6f}, lr {row['lr']:.2e}, "
                f"grad norm {row['grad_norm']:.4f}, {row['tokens_per_s']:,.0f} tokens/s, "
                f"peak memory {row['peak_memory_bytes'] / 2**20:,.0f} MiB")
        if "mfu" in row:
            text += f", MFU {100 * row['mfu']:.1f}%"
        text += f", {row['step_time_s']:.2f} s/step, elapsed {_clock(elapsed)}, ETA {_clock(eta)}"
        if row.get("diverged"):
            text += f" - skipped: not finite ({bad_in_a_row} in a row of --max-bad-steps {self.config.max_bad_steps})"
        if stopping:
            text += " - stopping: asked to stop (SIGTERM/SIGINT)"
        return text

    def export(self, path: str) -> None:
        """The whole model's fp32 weights, named as in the model, written by rank 0: ``*.safetensors``
        (when safetensors is installed), a ``save_pretrained`` directory that ``from_pretrained`` loads
        (Hugging Face models, a path without a suffix), else ``torch.save`` (load with
        ``torch.load(path, weights_only=True)``). Collective."""
        state = self.engine.gather_full_state(dst=0)
        if self.rank != 0:
            return
        bad = nonfinite_keys(state)
        if bad:
            raise ValueError(f"--export {path}: not written, {bad[0]} holds inf or NaN values (training diverged?)")
        from .export import write_export

        write_export(state, path, self.model, self.plan.seq_len)
        self.say(f"exported {len(state)} tensors to {path}")

    def close(self) -> None:
        """Finish the save in flight (its error is raised), release the engine and the save directory."""
        try:
            if self.checkpointer is not None:
                self.checkpointer.wait()
        finally:
            self.engine.close()
            if self.lock is not None:
                self.lock.release()
