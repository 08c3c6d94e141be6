"""mist-compiler: an automatic distributed-training compiler for large language models.

The Python API, the same pipeline (``mist_compiler.driver``) the CLI and the ``torch.compile``
backend run: ``capture`` (model -> Mist IR), ``analyze`` (model + plan -> predicted time and
memory), ``tune`` (model + cluster -> best plan), ``compile`` (model + plan -> this rank's
training engine), ``train`` (launch real training, as ``mistc train``) and ``Trainer`` (one
rank's training loop with checkpoints). A model is an ``nn.Module`` or a name (zoo, ``hf:config.json``,
``package.module:function``).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "capture": ("mist_compiler.driver", "capture"),
    "analyze": ("mist_compiler.driver", "analyze_plan"),
    "tune": ("mist_compiler.driver", "tune_model"),
    "compile": ("mist_compiler.driver", "build_engine"),
    "train": ("mist_compiler.cli.train", "train"),
    "Trainer": ("mist_compiler.training.trainer", "Trainer"),
    "TrainConfig": ("mist_compiler.training.trainer", "TrainConfig"),
}

__all__ = sorted(_API)


def __getattr__(name: str):
    # Imported on first use: `import mist_compiler` stays cheap (no torch import).
    if name in _API:
        module_name, attribute = _API[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'mist_compiler' has no attribute {name!r}")
