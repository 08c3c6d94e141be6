"""Checkpoints with ``torch.distributed.checkpoint`` (DCP) that any other plan can resume from.

What is saved (one DCP checkpoint per step directory, plus ``mist.json`` written by rank 0):

- ``model.<fqn>``, ``optim.exp_avg.<fqn>``, ``optim.exp_avg_sq.<fqn>``: the fp32 master weights
  and Adam moments, each a *full-shape logical tensor* of which every rank writes the boxes it
  owns (:mod:`.layout`: ZeRO shards, tensor-parallel pieces, each element once), offloaded parts
  included. DCP stores the boxes and, on load, each rank asks for the boxes it holds under its
  own plan; DCP reads the overlaps (``create_read_items_for_chunk_list``). That is the resharding:
  dp, tp, pp, ZeRO level and offload may all differ between save and load.
- ``rng.rank<r>``: each rank's torch RNG state (restored when the world is the same);
- ``mist.json``: step, optimizer step count, loss scaler, plan, model, shapes, run settings, and the
  manifest of the directory's files (:mod:`.integrity`).

The chunks are plain CPU tensors behind a small object implementing DCP's checkpointable hooks
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``) and two planners
that look them up: DTensor cannot express ZeRO shards that cut across parameters.

Saving is asynchronous and atomic: the state is staged to CPU at the step boundary (a copy), then
a background thread runs ``dcp.save`` over a dedicated gloo group (never interleaving with the
training collectives) into ``D/step-000010.tmp``; once every rank has written, rank 0 adds
``mist.json``, renames the directory to ``D/step-000010`` and replaces ``D/latest`` (os.replace).
A crash at any point leaves the last complete checkpoint and ``latest`` intact. Before writing,
the ranks agree (one all-reduce on the checkpoint group) that every value is finite: a checkpoint
holding an inf or NaN is never written, so ``latest`` never points to one. After publishing, rank 0
says where, how large and how long, and removes checkpoints beyond ``keep_last``. Any failure
(a full disk, a permission) is raised on every rank at the next step, in one line naming the cause
and the path.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .integrity import META, CheckpointError, build_manifest, nonfinite_keys, record_crcs_on
from .layout import BucketView, box_view, bucket_views
from .save_dir import directory_bytes, fsync_dir, human_bytes, prune, step_dir, write_atomically

KINDS = (("model", "master"), ("optim.exp_avg", "exp_avg"), ("optim.exp_avg_sq", "exp_avg_sq"))


class Chunks:
    """A full-shape tensor of which this rank has some boxes (DCP sees it like a sharded tensor)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = torch.Size(shape)
        self.chunks: dict[torch.Size, torch.Tensor] = {}  # offsets -> contiguous CPU tensor

    def size(self) -> torch.Size:
        return self.shape

    def add(self, offsets: tuple[int, ...], tensor: torch.Tensor) -> None:
        self.chunks[torch.Size(offsets)] = tensor

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, tensor.shape),
                                                      properties=TensorProperties.create_from_tensor(tensor),
                                                      size=self.shape))
                for offsets, tensor in self.chunks.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, tensor.shape) for offsets, tensor in self.chunks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.chunks[torch.Size(index.offset)]


def _lookup(state: dict[str, Any], index: MetadataIndex) -> Any:
    value = state[index.fqn]
    return value.__get_tensor_shard__(index) if isinstance(value, Chunks) else value


class ChunkSavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return _lookup(self.state_dict, index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata: Any = None, is_coordinator: bool = False) -> None:
        # the default set-up walks the state dict and replaces values of unknown types (ours) by None
        super().set_up_planner({}, metadata, is_coordinator)
        self.state_dict = self.original_state_dict = state_dict

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return _lookup(self.state_dict, index)


# ---- staging: the engine's state as chunks, and back -------------------------------------------------
def _buffers(view: BucketView) -> dict[str, Any]:
    bucket = view.bucket
    return {"master": bucket.master, "exp_avg": bucket.opt_state.exp_avg, "exp_avg_sq": bucket.opt_state.exp_avg_sq}


def stage_state(engine: Any, views: list[BucketView]) -> dict[str, Any]:
    """This rank's owned master weights and moments as CPU chunks (a copy: training may go on)."""
    state: dict[str, Any] = {}
    cpu = torch.device("cpu")
    for view in views:
        buffers = _buffers(view)
        for piece in view.owned:
            for prefix, kind in KINDS:
                flat = buffers[kind].read(piece.lo, piece.hi, cpu, engine.runtime.streams)
                chunks = state.setdefault(f"{prefix}.{piece.fqn}", Chunks(piece.full_shape))
                for local, full in piece.boxes(view.tp_index, view.tp):
                    values = box_view(flat, piece.piece_lo, piece.piece_shape, local)
                    chunks.add(full[0], values.to(torch.float32).clone(memory_format=torch.contiguous_format))
    rank = dist.get_rank() if dist.is_initialized() else 0
    state[f"rng.rank{rank}"] = torch.get_rng_state()
    if engine.device.type == "cuda":
        state[f"rng_cuda.rank{rank}"] = torch.cuda.get_rng_state(engine.device)
    return state


def checkpoint_group(timeout_s: float) -> dist.ProcessGroup | None:
    """The gloo group DCP's own collectives run on (CPU tensors, never interleaved with training's).
    Collective: every rank creates it, in the same order."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def load_state(engine: Any, views: list[BucketView], path: str, same_world: bool,
               group: dist.ProcessGroup | None = None) -> None:
    """Fill this rank's master weights and moments from the checkpoint at ``path`` (any plan's),
    then rebuild the compute weights. Collective: every rank calls it."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    saved = metadata.state_dict_metadata
    wanted: dict[str, Any] = {}
    for view in views:
        for piece in view.held:
            for prefix, _ in KINDS:
                key = f"{prefix}.{piece.fqn}"
                if key not in saved:
                    raise CheckpointError(f"checkpoint {path!r} has no {key!r}: it was saved for another model")
                if tuple(saved[key].size) != piece.full_shape:
                    raise CheckpointError(f"checkpoint {path!r}: {piece.fqn} has shape {tuple(saved[key].size)} there "
                                          f"but {piece.full_shape} in this model: it was saved for another model")
                chunks = wanted.setdefault(key, Chunks(piece.full_shape))
                for _, full in piece.boxes(view.tp_index, view.tp):
                    chunks.add(full[0], torch.empty(full[1], dtype=torch.float32))
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_keys = [k for k in (f"rng.rank{rank}", f"rng_cuda.rank{rank}") if k in saved] if same_world else []
    for key in rng_keys:
        wanted[key] = torch.empty(saved[key].size, dtype=torch.uint8)
    dcp.load(wanted, storage_reader=dcp.FileSystemReader(path), planner=ChunkLoadPlanner(), process_group=group)
    for view in views:
        buffers = _buffers(view)
        for piece in view.held:
            for prefix, kind in KINDS:
                chunks = wanted[f"{prefix}.{piece.fqn}"]
                flat = torch.empty(piece.hi - piece.lo, dtype=torch.float32)
                for local, full in piece.boxes(view.tp_index, view.tp):
                    box_view(flat, piece.piece_lo, piece.piece_shape, local).copy_(chunks.chunks[torch.Size(full[0])])
                buffers[kind].write(piece.lo, flat.to(buffers[kind].dtype))
    for view in views:
        for buffer in _buffers(view).values():
            buffer.sync_host()
    pendings = [view.bucket.write_back() for view in views]  # master -> compute weights (and ZeRO gathers)
    for pending in pendings:
        if pending is not None:
            pending.wait(engine.timeout_s)
    if engine.tied is not None:
        engine.tied.after_step()  # the last stage's copy of a tied weight from the first stage
    if f"rng.rank{rank}" in wanted:
        torch.set_rng_state(wanted[f"rng.rank{rank}"])
    if f"rng_cuda.rank{rank}" in wanted:
        torch.cuda.set_rng_state(wanted[f"rng_cuda.rank{rank}"], engine.device)


# ---- the saver ------------------------------------------------------------------------------------
class _RecordingStream:
    """A file DCP writes to, remembering the ``OSError`` of a failed write (with the file's path)."""

    def __init__(self, stream: Any, path: str, errors: list[OSError]) -> None:
        self._stream, self._path, self._errors = stream, path, errors

    def _recorded(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, method)(*args)
        except OSError as error:
            if error.filename is None:
                error.filename = self._path
            self._errors.append(error)
            raise

    def write(self, data: Any) -> Any:
        return self._recorded("write", data)

    def flush(self) -> None:
        self._recorded("flush")

    def close(self) -> None:
        self._recorded("close")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class RecordingFileSystem(FileSystem):
    """DCP's file system, keeping the ``OSError`` behind a failed write: ``torch.save`` turns it into a
    bare ``RuntimeError`` ("unexpected pos ...") and DCP drops the chain when it gathers failures."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield _RecordingStream(stream, str(path), self.errors) if "w" in mode else stream
        except OSError as error:
            if error not in self.errors:
                self.errors.append(error)
            raise


def _test_stall(step: int) -> float:
    """Seconds to sleep between writing and publishing the save of ``step``: ``MIST_CHECKPOINT_STALL=S:T``
    stalls step S's save T seconds (tests kill ranks there)."""
    spec = os.environ.get("MIST_CHECKPOINT_STALL", "")
    if ":" not in spec:
        return 0.0
    at, seconds = spec.split(":", 1)
    return float(seconds) if int(at) == step else 0.0


def describe_failure(error: BaseException) -> str:
    """One line for a failed save or load: the first ``OSError`` found (its text and path) in DCP's
    per-rank failures and the exception chain, else the error itself."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            text = current.strerror or str(current)
            path = current.filename
            return f"{text}: {path}" if path else text
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    if type(error).__name__ == "CheckpointException":
        return f"ranks {sorted(getattr(error, 'failures', {}) or {})} failed"
    return f"{type(error).__name__}: {error}"


@dataclass
class SaveTiming:
    step: int
    stage_s: float  # the training step waited this long (staging to CPU, plus any wait for the previous save)
    write_s: float = 0.0  # the background write, start to rename
    path: str = ""
    bytes: int = 0


class Checkpointer:
    """Saves (asynchronously unless ``blocking``) into ``save_dir``; one save in flight at a time.
    ``say`` (rank 0) gets one line per completed save; ``keep_last`` > 0 keeps only that many."""

    def __init__(self, engine: Any, save_dir: str | None, group: dist.ProcessGroup | None,
                 blocking: bool = False, keep_last: int = 0, say: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.save_dir = save_dir
        self.blocking = blocking
        self.keep_last = keep_last
        self.views = bucket_views(engine)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.say = say if say is not None and self.rank == 0 else (lambda line: None)
        self.group = group  # see checkpoint_group: a background save never interleaves with training's collectives
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.timings: list[SaveTiming] = []
        self.latest: str | None = None  # the last checkpoint this run published

    def save(self, step: int, meta: dict) -> SaveTiming:
        started = time.perf_counter()
        self.wait()
        state = stage_state(self.engine, self.views)
        timing = SaveTiming(step, 0.0)
        self.timings.append(timing)
        self.thread = threading.Thread(target=self._write, args=(step, state, meta, timing),
                                       name=f"mist-checkpoint-{step}", daemon=True)
        self.thread.start()
        if self.blocking:
            self.wait()
        timing.stage_s = time.perf_counter() - started
        return timing

    @property
    def in_flight(self) -> bool:
        return self.thread is not None

    def _agree(self, problem: str | None) -> str | None:
        """Every rank learns the first rank's problem (None: all fine). Collective on the checkpoint group."""
        if self.group is None:
            return problem
        problems: list[str | None] = [None] * self.world
        dist.all_gather_object(problems, problem, group=self.group)
        return next((p for p in problems if p is not None), None)

    @staticmethod
    def _attempt(action: Callable[[], Any]) -> str | None:
        try:
            action()
        except OSError as error:
            return describe_failure(error)
        return None

    def _write(self, step: int, state: dict, meta: dict, timing: SaveTiming) -> None:
        started = time.perf_counter()
        final = step_dir(self.save_dir, step)
        tmp = final + ".tmp"
        try:
            bad = nonfinite_keys(state)
            problem = f"rank {self.rank}: {bad[0]} holds inf or NaN values (training diverged?)" if bad else None
            if problem is None and self.rank == 0:
                problem = self._attempt(lambda: (os.makedirs(self.save_dir, exist_ok=True),
                                                 shutil.rmtree(tmp, ignore_errors=True)))  # left by a dead run
            problem = self._agree(problem)  # also the barrier: the stale directory is gone before anyone writes
            if problem is not None:
                raise CheckpointError(f"checkpoint of step {step} not written: {problem}; latest still names the "
                                      f"previous one")
            problem = self._agree(self._attempt(lambda: os.makedirs(tmp, exist_ok=True)))
            if problem is not None:
                raise CheckpointError(f"saving checkpoint {tmp} failed: {problem}")
            record_crcs = record_crcs_on()
            writer = dcp.FileSystemWriter(tmp, thread_count=1)
            writer.fs = files = RecordingFileSystem()
            try:
                metadata = dcp.save(state, storage_writer=writer, planner=ChunkSavePlanner(), process_group=self.group)
            except BaseException as error:  # CheckpointException derives from BaseException; every rank gets it
                mine = describe_failure(files.errors[0]) if files.errors else None
                problem = self._agree(mine) or describe_failure(error)
                raise CheckpointError(f"saving checkpoint {tmp} failed: {problem}") from error
            time.sleep(_test_stall(step))
            problem = None
            if self.rank == 0:
                try:
                    self._publish(step, meta, metadata, tmp, final, record_crcs, timing, started)
                except BaseException as error:  # noqa: BLE001 (a full disk here must reach every rank)
                    problem = describe_failure(error)
            problem = self._agree(problem)
            if problem is not None:
                raise CheckpointError(f"saving checkpoint {tmp} failed: {problem}")
        except BaseException as error:  # reported on the training thread at the next wait()
            self.error = error
        timing.write_s = time.perf_counter() - started

    def _publish(self, step: int, meta: dict, metadata: Any, tmp: str, final: str, record_crcs: bool,
                 timing: SaveTiming, started: float) -> None:
        """Rank 0, once every rank has written: manifest and mist.json, rename, ``latest``, prune, say."""
        shapes = {k[len("model."):]: list(v.size) for k, v in metadata.state_dict_metadata.items()
                  if k.startswith("model.")}
        files = build_manifest(tmp, record_crcs)
        write_atomically(os.path.join(tmp, META), json.dumps({**meta, "step": step, "shapes": shapes,
                                                              "files": files}, indent=1))
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)  # an older save of the same step
        os.rename(tmp, final)
        fsync_dir(self.save_dir)
        write_atomically(os.path.join(self.save_dir, "latest"), os.path.basename(final) + "\n")
        self.latest = final
        timing.path, timing.bytes = final, directory_bytes(final)
        removed = prune(self.save_dir, self.keep_last, step)
        kept = [name for name in removed if not name.endswith(".tmp")]
        self.say(f"saved {final} ({human_bytes(timing.bytes)} in {time.perf_counter() - started:.2f} s)"
                 + (f"; removed {', '.join(kept)} (--keep-last {self.keep_last})" if kept else ""))

    def failed(self) -> bool:
        """Whether the save in flight has finished with an error (``wait`` raises it); never blocks."""
        return self.thread is not None and not self.thread.is_alive() and self.error is not None

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; re-raise its error in one line."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"saving a checkpoint into {self.save_dir} failed: "
                                  f"{describe_failure(error)}") from error
