"""A trained model's full state dict for use outside mist (``mistc train --export PATH``).

- ``PATH`` ending in ``.safetensors``: safetensors (needs the ``safetensors`` package);
- ``hf:...`` models and a ``PATH`` without a suffix: ``save_pretrained(PATH)`` of the Hugging Face
  model with these weights (config, weights, tied weights as Hugging Face ties them);
- anything else: ``torch.save`` of a plain ``{name: tensor}`` dict, loadable with
  ``torch.load(PATH, weights_only=True)``.
Tied weights appear once, under the name the model registers first.
"""
from __future__ import annotations

import os

import torch


def write_export(state: dict[str, torch.Tensor], path: str, model_name: str, seq_len: int) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in state.items()}
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError as error:
            raise ValueError("--export *.safetensors needs the safetensors package") from error
        save_file(state, path)
        return
    if model_name.startswith("hf:") and not os.path.splitext(path)[1]:
        from ..models import build_model

        model = build_model(model_name, seq_len=seq_len)
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {name for name in missing if name.endswith("weight") and "head" in name}
        if set(missing) - tied or unexpected:
            raise ValueError(f"--export: the trained state does not fit {model_name}: missing {sorted(missing)[:4]}, "
                             f"unexpected {sorted(unexpected)[:4]}")
        model.save_pretrained(path)
        return
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)
