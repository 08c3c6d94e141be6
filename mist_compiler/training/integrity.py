"""Checkpoint integrity: a manifest of every file, checked before a resume, naming what is damaged.

A step directory holds DCP's ``.metadata`` (the index: which bytes of which file hold which
tensor chunk), one ``__<rank>_0.distcp`` file per rank and ``mist.json``. Each tensor chunk in a
``.distcp`` file is a ``torch.save`` record: a small zip archive whose members carry a CRC-32 that
``torch.save`` computes as it writes (``torch.utils.serialization.config.save.compute_crc32``, on by
default) but that ``torch.load`` never checks. So the integrity data is:

- ``mist.json["files"]``, the manifest written at save time: every file's size in bytes, plus a
  CRC-32 of ``.metadata`` (small) and, only when torch's record CRCs were switched off, of each
  whole data file. Saving costs a ``stat`` per file and no extra pass over the data.
- on resume, :func:`check_manifest` (cheap, in the launcher before any rank starts): every file
  present at its recorded size (a truncated shard is named here), ``.metadata`` matching its CRC;
- then :func:`verify_data_files` (each rank a share of the files, while the model compiles): every
  record's data against its CRC-32, and the zip structure around it. A damaged file is named with
  the tensor chunk it holds.

Checkpoints written before the manifest existed (no ``files`` key) are loaded unverified.
"""
from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
import threading
import zipfile
import zlib
from typing import Any

import torch

META = "mist.json"
DCP_METADATA = ".metadata"
_CHUNK = 1 << 24


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why."""


def _file_crc32(path: str) -> str:
    value = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def record_crcs_on() -> bool:
    """Whether ``torch.save`` writes CRC-32s into its records (torch's default)."""
    try:
        from torch.utils.serialization import config

        return bool(config.save.compute_crc32)
    except (ImportError, AttributeError):
        return False


def build_manifest(path: str, record_crcs: bool) -> dict[str, dict[str, Any]]:
    """Size (and where needed a CRC-32) of every file in the step directory ``path`` but ``mist.json``."""
    files: dict[str, dict[str, Any]] = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == META or not os.path.isfile(full):
            continue
        entry: dict[str, Any] = {"bytes": os.path.getsize(full)}
        if name == DCP_METADATA or not record_crcs:
            entry["crc32"] = _file_crc32(full)
        files[name] = entry
    return files


def check_manifest(path: str, meta: dict) -> None:
    """Every file of the manifest present at its size, and ``.metadata`` intact; else a named error."""
    files = meta.get("files")
    if not isinstance(files, dict):
        return  # saved before manifests existed
    for name, entry in sorted(files.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint {path!r} is damaged: {name} is missing")
        size = os.path.getsize(full)
        if size != entry.get("bytes"):
            raise CheckpointError(f"checkpoint {path!r} is damaged: {name} has {size} bytes, the manifest says "
                                  f"{entry.get('bytes')} (truncated or overwritten)")
        if name == DCP_METADATA and entry.get("crc32") and _file_crc32(full) != entry["crc32"]:
            raise CheckpointError(f"checkpoint {path!r} is damaged: {name} does not match its CRC-32")


def data_files(meta: dict) -> list[str]:
    """The manifest's data files (everything but ``.metadata``), in a fixed order."""
    return sorted(name for name in (meta.get("files") or {}) if name != DCP_METADATA)


class _Slice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of a file as a seekable stream (what ``zipfile`` reads)."""

    def __init__(self, handle: Any, offset: int, length: int) -> None:
        super().__init__()
        self.handle, self.offset, self.length, self.position = handle, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(base + position, 0)
        return self.position

    def read(self, size: int = -1) -> bytes:
        end = self.length if size is None or size < 0 else min(self.length, self.position + size)
        if end <= self.position:
            return b""
        self.handle.seek(self.offset + self.position)
        data = self.handle.read(end - self.position)
        self.position += len(data)
        return data


def _records(path: str) -> dict[str, list[tuple[str, int, int]]]:
    """Per data file, its records as (what they hold, offset, length), from DCP's ``.metadata``."""
    with open(os.path.join(path, DCP_METADATA), "rb") as handle:
        metadata = pickle.load(handle)  # DCP's own format (it unpickles it the same way to load)
    records: dict[str, list[tuple[str, int, int]]] = {}
    for index, info in metadata.storage_data.items():
        where = f"{index.fqn}" + (f" at {tuple(index.offset)}" if index.offset is not None and len(index.offset) else "")
        records.setdefault(info.relative_path, []).append((where, info.offset, info.length))
    return records


def _check_record(handle: Any, view: memoryview, offset: int, length: int) -> str | None:
    """None when every member of the zip record at ``offset`` matches its CRC-32; else what is wrong."""
    try:
        with zipfile.ZipFile(_Slice(handle, offset, length)) as archive:
            for info in archive.infolist():
                start = offset + info.header_offset
                if view[start:start + 4] != b"PK\x03\x04":
                    return f"member {info.filename} has no local header"
                name_len, extra_len = struct.unpack("<HH", view[start + 26:start + 30])
                data = start + 30 + name_len + extra_len
                if data + info.compress_size > offset + length:
                    return f"member {info.filename} runs past the record"
                if zlib.crc32(view[data:data + info.compress_size]) != info.CRC:
                    return f"member {info.filename} does not match its CRC-32"
    except (zipfile.BadZipFile, struct.error, ValueError, EOFError) as error:
        return f"the record is unreadable ({error})"
    return None


def verify_data_file(path: str, name: str, meta: dict) -> str | None:
    """None when data file ``name`` of the checkpoint at ``path`` is intact; else a line naming the damage."""
    full = os.path.join(path, name)
    entry = (meta.get("files") or {}).get(name, {})
    if entry.get("crc32"):
        return None if _file_crc32(full) == entry["crc32"] else f"{name} does not match its CRC-32"
    try:
        records = _records(path).get(name, [])
    except Exception as error:  # noqa: BLE001 (any unpickling failure means a damaged index)
        return f"{DCP_METADATA} cannot be read ({type(error).__name__}: {error})"
    with open(full, "rb") as handle:
        if os.path.getsize(full) == 0:
            return f"{name} is empty" if records else None
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for what, offset, length in sorted(records, key=lambda record: record[1]):
                    problem = _check_record(handle, view, offset, length)
                    if problem is not None:
                        return f"{name} is damaged in the record of {what} (bytes {offset}..{offset + length}): {problem}"
            finally:
                view.release()
    return None


def verify_data_files(path: str, meta: dict, rank: int = 0, world: int = 1) -> list[str]:
    """Check this rank's share of the data files (every ``world``-th, from ``rank``); the problems found."""
    problems = []
    for name in data_files(meta)[rank::world]:
        problem = verify_data_file(path, name, meta)
        if problem is not None:
            problems.append(problem)
    return problems


class BackgroundVerification:
    """:func:`verify_data_files` of this rank's share on a thread (started before the model compiles,
    so the check overlaps it); :meth:`problems` waits for it."""

    def __init__(self, path: str, meta: dict, rank: int, world: int) -> None:
        self._found: list[str] = []
        self._thread = threading.Thread(target=self._run, args=(path, meta, rank, world),
                                        name="mist-verify-checkpoint", daemon=True)
        self._thread.start()

    def _run(self, path: str, meta: dict, rank: int, world: int) -> None:
        try:
            self._found.extend(verify_data_files(path, meta, rank, world))
        except Exception as error:  # noqa: BLE001 (a file that vanished or cannot be read is damage too)
            self._found.append(f"{type(error).__name__}: {error}")

    def problems(self) -> list[str]:
        self._thread.join()
        return list(self._found)


def nonfinite_keys(state: dict[str, Any]) -> list[str]:
    """The keys of ``state`` whose floating-point values (tensors, or checkpoint chunks) hold an inf or NaN."""
    bad = []
    for key, value in state.items():
        tensors = value.chunks.values() if hasattr(value, "chunks") else [value]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel() \
                    and not torch.isfinite(tensor.sum(dtype=torch.float64)):
                bad.append(key)
                break
    return bad
