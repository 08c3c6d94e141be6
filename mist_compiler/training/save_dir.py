"""A run's save directory on disk: its step directories, ``latest``, the lock, and the checks made
before any rank starts.

Layout of ``D`` (``--save-dir``)::

    D/.lock                 the run that owns D (host, pid, start time, command); see RunLock
    D/step-000010/          a complete checkpoint (DCP files + mist.json with the manifest)
    D/step-000020.tmp/      a save in progress (renamed when complete; removed if a run died in it)
    D/latest                "step-000020": the newest complete checkpoint (replaced atomically)

Ownership: one run at a time holds ``D/.lock``, created with ``O_EXCL``. A lock is stale when its
owner is on this host and its process is gone, or, from another host, when its owner has not
refreshed it for ``STALE_AFTER_S`` (the owner touches it every ``REFRESH_S``); a stale lock is
taken over with a warning, a live one refuses the second run naming the owner. A run that starts
without ``--resume`` in a directory that already holds checkpoints is refused unless
``--overwrite`` (which deletes them first).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
from typing import Callable

from .integrity import META, CheckpointError

STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-(\d+)\.tmp$")
LOCK = ".lock"
REFRESH_S = 30.0
STALE_AFTER_S = 300.0
REQUIRED_META = ("model", "plan", "world", "step", "optimizer_steps")


def step_dir(save_dir: str, step: int) -> str:
    return os.path.join(save_dir, f"step-{step:06d}")


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META)) and os.path.isfile(os.path.join(path, ".metadata"))


def complete_steps(save_dir: str) -> list[tuple[int, str]]:
    """(step, directory name) of every complete checkpoint in ``save_dir``, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    return sorted((int(m.group(1)), name) for name in os.listdir(save_dir)
                  if (m := STEP_DIR.match(name)) and is_complete(os.path.join(save_dir, name)))


def latest_name(save_dir: str) -> str | None:
    try:
        with open(os.path.join(save_dir, "latest")) as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def resolve(path: str) -> str:
    """The complete checkpoint ``path`` names: a step directory, or a save directory (its ``latest``,
    else its highest complete step)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"--resume: {path!r} is not a directory")
    if is_complete(path):
        return path
    named = latest_name(path)
    if named and is_complete(os.path.join(path, named)):
        return os.path.join(path, named)
    steps = complete_steps(path)
    if not steps:
        raise CheckpointError(f"--resume: {path!r} holds no complete checkpoint")
    return os.path.join(path, steps[-1][1])


def read_meta(path: str) -> dict:
    """``mist.json`` of the checkpoint at ``path``, checked; errors name the file and what is wrong."""
    file = os.path.join(path, META)
    try:
        with open(file, encoding="utf-8") as handle:
            meta = json.load(handle)
    except OSError as error:
        raise CheckpointError(f"checkpoint {path!r}: cannot read {META}: {error.strerror or error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"checkpoint {path!r} is damaged: {META} is not valid JSON ({error})") from error
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint {path!r} is damaged: {META} is not a JSON object")
    missing = [key for key in REQUIRED_META if key not in meta]
    if missing:
        raise CheckpointError(f"checkpoint {path!r} is damaged: {META} has no {missing}")
    if not isinstance(meta["step"], int) or not isinstance(meta["world"], int) or not isinstance(meta["plan"], dict):
        raise CheckpointError(f"checkpoint {path!r} is damaged: {META} fields step/world/plan have the wrong types")
    return meta


def write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)
               if os.path.isfile(os.path.join(path, name)))


def prune(save_dir: str, keep_last: int, newest: int) -> list[str]:
    """After publishing step ``newest``: remove complete checkpoints beyond the newest ``keep_last``
    (0 keeps all; ``latest``'s target always stays) and ``.tmp`` leftovers of runs that died while
    saving. Returns the removed directory names."""
    removed = []
    keep = {latest_name(save_dir)}
    steps = complete_steps(save_dir)
    if keep_last > 0:
        keep |= {name for _, name in steps[-keep_last:]}
        for _, name in steps:
            if name not in keep:
                shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
                removed.append(name)
    for name in os.listdir(save_dir):
        match = TMP_DIR.match(name)
        if match and int(match.group(1)) != newest:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


# ---- ownership ------------------------------------------------------------------------------------
def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """``D/.lock``, held by one run (see the module docstring). ``token`` identifies the holder."""

    def __init__(self, save_dir: str, token: str) -> None:
        self.save_dir, self.token = save_dir, token
        self.path = os.path.join(save_dir, LOCK)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def acquire(cls, save_dir: str, command: str = "",
                warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> "RunLock":
        os.makedirs(save_dir, exist_ok=True)
        lock = cls(save_dir, uuid.uuid4().hex)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "token": lock.token,
                  "command": command}
        for _ in range(3):
            try:
                fd = os.open(lock.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = read_lock(lock.path)
                why = stale_reason(lock.path, owner)
                if why is None:
                    raise CheckpointError(_held_message(save_dir, owner)) from None
                warn(f"mist: warning: --save-dir {save_dir}: taking over a stale lock ({why})")
                try:
                    os.unlink(lock.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(record, handle)
            lock._thread = threading.Thread(target=lock._refresh, name="mist-save-dir-lock", daemon=True)
            lock._thread.start()
            return lock
        raise CheckpointError(f"--save-dir {save_dir}: could not take its lock {lock.path} (another run keeps "
                              f"taking it)")

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        owner = read_lock(self.path)
        if owner is not None and owner.get("token") == self.token:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def read_lock(path: str) -> dict | None:
    try:
        with open(path) as handle:
            owner = json.load(handle)
        return owner if isinstance(owner, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written, or garbage: judged by its age


def stale_reason(path: str, owner: dict | None) -> str | None:
    """Why the lock at ``path`` no longer protects anything, or None while its owner may be running."""
    if owner is None:
        return "it is gone"
    if owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int):
        return None if _process_alive(owner["pid"]) else f"its owner, pid {owner['pid']} on this host, has exited"
    try:
        age = time.time() - os.path.getmtime(path)
    except OSError:
        return "it is gone"
    if age > STALE_AFTER_S:
        return f"its owner on {owner.get('host', '?')} has not refreshed it for {age:.0f} s"
    return None


def held_by(save_dir: str, token: str | None) -> bool:
    owner = read_lock(os.path.join(save_dir, LOCK))
    return bool(token) and owner is not None and owner.get("token") == token


def _held_message(save_dir: str, owner: dict | None) -> str:
    owner = owner or {}
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["started"])) if "started" in owner else "?"
    return (f"--save-dir {save_dir} is in use by another run (pid {owner.get('pid', '?')} on "
            f"{owner.get('host', '?')}, since {since}); wait for it, or use another directory")


def check_ownership(save_dir: str, resume: str | None, overwrite: bool) -> None:
    """Refuse to start a new run over a directory that already holds checkpoints (see the module docstring)."""
    steps = complete_steps(save_dir)
    if not steps or overwrite:
        return
    if resume is not None:
        source = resume if os.path.isdir(resume) and not is_complete(resume) else os.path.dirname(resume.rstrip("/"))
        if os.path.realpath(source) == os.path.realpath(save_dir):
            return
    newest = latest_name(save_dir) or steps[-1][1]
    raise CheckpointError(f"--save-dir {save_dir} already holds checkpoints (latest: {newest}); continue that run "
                          f"with --resume {save_dir}, or pass --overwrite to delete them and start over")


def clear_checkpoints(save_dir: str) -> None:
    """--overwrite: delete every step directory and ``latest`` (the lock is kept)."""
    if not os.path.isdir(save_dir):
        return
    for name in os.listdir(save_dir):
        if STEP_DIR.match(name) or TMP_DIR.match(name):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    try:
        os.unlink(os.path.join(save_dir, "latest"))
    except FileNotFoundError:
        pass


# ---- before any rank starts -----------------------------------------------------------------------
def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def check_writable(option: str, directory: str, needed_bytes: int, what: str = "one checkpoint") -> None:
    """``directory`` (created if missing) accepts a file and has about ``needed_bytes`` free for ``what``;
    else one line naming the option, the path and the cause."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".mist-write-test-{os.getpid()}")
        with open(probe, "wb") as handle:
            handle.write(b"x")
            handle.flush()
            os.fsync(handle.fileno())
        os.unlink(probe)
    except OSError as error:
        raise CheckpointError(f"{option} {directory}: not writable ({error.strerror or error})") from error
    free = shutil.disk_usage(directory).free
    if needed_bytes and free < needed_bytes:
        raise CheckpointError(f"{option} {directory}: {human_bytes(free)} free, but {what} needs about "
                              f"{human_bytes(needed_bytes)} (no space left on device)")

