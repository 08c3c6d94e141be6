"""mist-compiler: an automatic distributed-training compiler for large language models.

The Python API the CLI and the dynamo backend are thin layers over:
``capture`` (model -> Mist IR), ``analyze`` (plan -> predicted time and memory),
``tune`` (model + cluster -> best plan), ``compile`` (model + plan -> training engine).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "capture": ("mist_compiler.frontend.capture", "capture"),
    "analyze": ("mist_compiler.cost.analyze", "analyze"),
    "tune": ("mist_compiler.tuner.api", "tune"),
    "compile": ("mist_compiler.backends.engine", "compile"),
}

__all__ = sorted(_API)


def __getattr__(name: str):
    # Imported on first use: `import mist_compiler` stays cheap (no torch import).
    if name in _API:
        module_name, attribute = _API[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'mist_compiler' has no attribute {name!r}")
