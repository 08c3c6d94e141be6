"""Capture: a model -> the captured program (one dynamo trace: the torch-level model graph and its
joint forward+backward ATen graph under FakeTensorMode), layers found and proven, the analysis
passes run. May import ``ir``, ``ops``, ``models`` and ``passes``.

Names are imported lazily (torch is heavy). ``capture`` is also the submodule's name, so use
``mist_compiler.capture`` or ``mist_compiler.frontend.capture.capture`` for the function.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelOutputError": "joint", "UnsupportedOpError": "to_ir",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'mist_compiler.frontend' has no attribute {name!r}")
