"""Capture: dynamo backend entry, joint forward+backward ATen graphs under FakeTensorMode, block discovery.

Names are imported lazily (torch is heavy). ``capture`` is also the submodule's name, so use
``mist_compiler.capture`` or ``mist_compiler.frontend.capture.capture`` for the function.
The "mist" torch.compile backend is ``dynamo_backend.mist_backend`` (found through the package's entry point).
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "CaptureState": "capture",
    "mist_backend": "dynamo_backend", "last_program": "dynamo_backend",
    "ModelOutputError": "joint", "UnsupportedOpError": "lowering",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'mist_compiler.frontend' has no attribute {name!r}")
