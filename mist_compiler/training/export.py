"""A trained model's full state dict for use outside mist (``mistc train --export PATH``).

- ``PATH`` ending in ``.safetensors``: safetensors (needs the ``safetensors`` package);
- a ``PATH`` without a suffix, for a Hugging Face model (``hf:`` names, a factory or a module that
  is a ``PreTrainedModel``): a ``save_pretrained`` directory that ``from_pretrained`` loads (config,
  generation config, the trained fp32 weights, tied weights tied as Hugging Face ties them). The
  model is rebuilt on the meta device and given the trained tensors: nothing is copied, and the
  user's module is left as it is;
- anything else: ``torch.save`` of a plain ``{name: tensor}`` dict, loadable with
  ``torch.load(PATH, weights_only=True)``.
Tied weights appear once, under the name the model registers first (the directory form writes
them as Hugging Face does). Persistent buffers come from the model as it starts (they are not trained).
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn


class ExportError(ValueError):
    """The trained state cannot be written as asked; the message names the path or the tensor."""


def hugging_face_skeleton(model: nn.Module | str, seq_len: int | None) -> nn.Module | None:
    """The model as a ``PreTrainedModel`` on the meta device (its class and config), or None when it
    is not a Hugging Face model."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    with torch.device("meta"):
        if isinstance(model, str):
            from ..models import resolve_model

            built = resolve_model(model, seq_len).build()
        elif isinstance(model, PreTrainedModel):
            built = type(model)._from_config(model.config)
            built.generation_config = getattr(model, "generation_config", None)
        else:
            return None
    return built if isinstance(built, PreTrainedModel) else None


def _persistent_buffers(model: nn.Module) -> list[str]:
    names = []
    for module_name, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                names.append(f"{module_name}.{key}" if module_name else key)
    return names


def save_pretrained(skeleton: nn.Module, state: dict[str, torch.Tensor], path: str,
                    buffers: Callable[[], Any]) -> None:
    """``skeleton.save_pretrained(path)`` with ``state``'s tensors (and ``buffers().full("buffer", name)``
    for persistent buffers)."""
    aliases: dict[int, list[str]] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    full = {}
    for names in aliases.values():
        given = next((name for name in names if name in state), None)
        if given is None:
            raise ExportError(f"--export {path}: the trained state has no {names[0]} (a state of another model?)")
        full.update({name: state[given] for name in names})
    unexpected = sorted(set(state) - set(full))
    if unexpected:
        raise ExportError(f"--export {path}: the trained state has {unexpected[0]}, which the model has not")
    persistent = _persistent_buffers(skeleton)
    source = buffers() if persistent else None
    for name in persistent:
        full[name] = source.full("buffer", name).detach().to("cpu")
    skeleton.load_state_dict(full, strict=False, assign=True)
    skeleton.tie_weights()  # one tensor again where the model ties them
    for name, buffer in skeleton.named_buffers():  # non-persistent ones are rebuilt by from_pretrained
        if buffer.is_meta:
            module_name, _, key = name.rpartition(".")
            skeleton.get_submodule(module_name)._buffers[key] = torch.zeros_like(buffer, device="cpu")
    skeleton.config.dtype = torch.float32  # the weights written are the fp32 masters
    skeleton.save_pretrained(path)


def _initial_tensors(model: nn.Module | str, seq_len: int | None) -> Any:
    from ..lowering.materialize import InitTensors, ModuleTensors

    return ModuleTensors(model) if isinstance(model, nn.Module) else InitTensors(model, seq_len)


def write_export(state: dict[str, torch.Tensor], path: str, model: nn.Module | str, seq_len: int,
                 buffers: Callable[[], Any] | None = None) -> None:
    """Write ``state`` (full fp32 tensors named as in ``model``) to ``path`` (see the module docstring).
    ``buffers``: makes a tensor source of the model's buffers (asked only when it has persistent ones)."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in state.items()}
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError as error:
            raise ExportError("--export *.safetensors needs the safetensors package") from error
        save_file(state, path)
        return
    skeleton = hugging_face_skeleton(model, seq_len) if not os.path.splitext(path)[1] else None
    if skeleton is not None:
        if os.path.isfile(path):
            raise ExportError(f"--export {path}: a file is in the way of the save_pretrained directory")
        save_pretrained(skeleton, state, path, buffers or (lambda: _initial_tensors(model, seq_len)))
        return
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)
