"""Host allocator setting of CPU ranks: freed large tensors stay in the heap for reuse."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mist_compiler.runtime import host_allocator
from mist_compiler.runtime.host_allocator import keep_freed_host_memory

GLIBC = sys.platform.startswith("linux") and host_allocator._glibc() is not None

# Resident bytes a freed, touched 256 MB tensor leaves behind: glibc's defaults unmap it at once
_PROBE = """
import torch
from mist_compiler.runtime.host_allocator import keep_freed_host_memory

def resident() -> int:
    with open("/proc/self/status") as status:
        return 1024 * int(next(line for line in status if line.startswith("VmRSS")).split()[1])

applied = keep_freed_host_memory()
tensor = torch.ones(64 << 20)
touched = resident()
del tensor
print(applied, touched - resident())
"""


def _probe(choice: str) -> tuple[bool, int]:
    env = {**os.environ, host_allocator.ENV_VAR: choice}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120, check=True)
    applied, released = out.stdout.split()
    return applied == "True", int(released)


@pytest.mark.skipif(not GLIBC, reason="the setting is glibc's")
def test_freed_memory_stays_in_the_heap():
    applied, released = _probe("keep")
    assert applied and released < 16 << 20
    applied, released = _probe("system")
    assert not applied and released > 200 << 20  # the default: unmapped at once, page-faulted in next step


def test_bad_choice_names_the_variable(monkeypatch):
    monkeypatch.setattr(host_allocator, "_applied", False)
    monkeypatch.setenv(host_allocator.ENV_VAR, "jemalloc")
    with pytest.raises(ValueError, match="MIST_HOST_MALLOC"):
        keep_freed_host_memory()


def test_system_choice_changes_nothing(monkeypatch):
    monkeypatch.setattr(host_allocator, "_applied", False)
    monkeypatch.setenv(host_allocator.ENV_VAR, "system")
    assert keep_freed_host_memory() is False
