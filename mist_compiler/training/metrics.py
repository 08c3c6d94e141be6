"""The metrics file of a training run: one JSON object per step, appended, never truncated.

- Rows are strict JSON: a non-finite float (a diverged loss or gradient norm) is written as
  ``null``, never as the bare ``NaN``/``Infinity`` that ``json.dumps`` emits by default.
- The file is only ever appended to: a resumed run adds its rows after the earlier ones, so the
  steps redone after the checkpoint appear twice and the later row counts (:func:`read_metrics`
  returns that view).
- A run killed while writing leaves a partial last row. Opening the file again ends that row with a
  newline (so the next row stays whole) and warns; :func:`read_metrics` skips such rows, naming the
  line, instead of failing.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Callable


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON ``null``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def _warn(message: str) -> None:
    print(f"mist: warning: {message}", file=sys.stderr, flush=True)


class MetricsLog:
    """Appends one strict-JSON row per step to ``path`` (rank 0 only)."""

    def __init__(self, path: str, warn: Callable[[str], None] = _warn) -> None:
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.handle = open(path, "a+b")
        self.handle.seek(0, os.SEEK_END)
        if self.handle.tell() > 0:
            self.handle.seek(-1, os.SEEK_END)
            if self.handle.read(1) != b"\n":  # killed in the middle of a row: keep it apart from ours
                warn(f"metrics file {path!r} ends in a partial row (a run stopped while writing it); "
                     f"it is kept and skipped by readers")
                self.handle.write(b"\n")

    def write(self, row: dict) -> None:
        line = json.dumps(json_safe(row), allow_nan=False) + "\n"
        self.handle.write(line.encode())
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def read_metrics(path: str, warn: Callable[[str], None] = _warn) -> list[dict]:
    """The rows of a metrics file, one per step in step order (a later row for the same step wins);
    rows that are not whole JSON objects are skipped with a warning naming their line."""
    by_step: dict[int, dict] = {}
    extra: list[dict] = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if not isinstance(row, dict):
                warn(f"metrics file {path!r}: line {number} is not a whole JSON object (a partial row?); skipped")
                continue
            if isinstance(row.get("step"), int):
                by_step[row["step"]] = row
            else:
                extra.append(row)
    return [by_step[step] for step in sorted(by_step)] + extra
