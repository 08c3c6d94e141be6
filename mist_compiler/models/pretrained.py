"""Pretrained weights: ``hf:DIR`` checkpoints, factories that call ``from_pretrained``, slice reads.

A checkpoint is what Hugging Face's ``save_pretrained`` writes into a directory: ``config.json``
and the weights as ``model.safetensors``, or as shards listed by ``model.safetensors.index.json``.
:class:`Checkpoint` maps tensor names to files and reads a tensor, or only some slices of one of
its dimensions (safetensors' ``get_slice``: nothing else is read from disk). Pickled weights
(``pytorch_model.bin``) are refused: loading them runs code.

Models are built whole only for references; capture and the ranks of a plan build them
*virtually* (under a FakeTensorMode or on the meta device: :func:`is_virtual_build`). A virtual
build must not read weights, so inside :func:`reading_deferred` ``from_pretrained`` builds the
model from its config (``_from_config``, the same modules and names) and records which checkpoint
holds its weights instead of loading them. :func:`checkpoint_names` then says, for a built model,
where each of its tensors is stored: its own name, or (tied weights, which Hugging Face stores
once) the stored name of another name of the same tensor. A tensor the model's code changed after
``from_pretrained`` returned (seen by its version counter or by being replaced) is not taken from
the checkpoint: it comes from a whole build, as the factory made it.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read; the message names the file."""


def holds_weights(folder: str) -> bool:
    """Whether ``folder`` holds model weights of any format (safetensors or pickled)."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in (WEIGHTS_FILE, INDEX_FILE) + PICKLED_WEIGHTS)


@dataclass
class Checkpoint:
    """The safetensors weights of one directory, by tensor name (opened lazily, read by slice)."""

    folder: str
    files: dict[str, str]  # tensor name -> file path
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def open(cls, folder: str) -> "Checkpoint":
        folder = os.path.abspath(folder)
        index, single = os.path.join(folder, INDEX_FILE), os.path.join(folder, WEIGHTS_FILE)
        try:
            from safetensors import safe_open
        except ImportError:
            raise CheckpointError("reading pretrained weights needs the safetensors package "
                                  "(pip install safetensors)") from None
        if os.path.isfile(index):
            try:
                with open(index) as handle:
                    weight_map = json.load(handle)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index}: not a safetensors index (no weight_map): {error}") from None
            files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
            missing = sorted({path for path in files.values() if not os.path.isfile(path)})
            if missing:
                raise CheckpointError(f"{index} lists {os.path.basename(missing[0])}, which is not in {folder}")
            return cls(folder, files)
        if os.path.isfile(single):
            try:
                with safe_open(single, framework="pt") as handle:
                    names = list(handle.keys())
            except Exception as error:  # safetensors raises its own error types for a damaged header
                raise CheckpointError(f"{single} is not a safetensors file: {error}") from None
            return cls(folder, {name: single for name in names})
        if any(os.path.isfile(os.path.join(folder, name)) for name in PICKLED_WEIGHTS):
            raise CheckpointError(f"{folder} holds pickled weights (pytorch_model.bin), which mist does not load "
                                  "(loading a pickle runs code); convert them with "
                                  "save_pretrained(..., safe_serialization=True)")
        raise CheckpointError(f"{folder} holds no weights ({WEIGHTS_FILE} or {INDEX_FILE})")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        from safetensors import safe_open

        path = self.files[name]
        with self._lock:
            if path not in self._handles:
                self._handles[path] = safe_open(path, framework="pt")
            return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int = 0, slices: list[slice] | None = None) -> torch.Tensor:
        """Tensor ``name``, or only ``slices`` of its dimension ``dim`` (concatenated in order)."""
        if name not in self.files:
            raise KeyError(f"{self.folder} has no tensor {name!r}")
        handle = self._handle(name)
        if slices is None:
            return handle.get_tensor(name)
        view = handle.get_slice(name)
        lead = (slice(None),) * dim
        parts = [view[lead + (part,)] for part in slices]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def is_virtual_build() -> bool:
    """Whether tensors made now have no storage: a FakeTensorMode is active or the default device is meta."""
    return torch.get_default_device().type == "meta" or torch._guards.detect_fake_mode() is not None


# ---- from_pretrained, deferred -------------------------------------------------------------------

@dataclass
class _Loaded:
    """A module ``from_pretrained`` returned during a virtual build, and its tensors as they were then."""

    module: nn.Module
    checkpoint: Checkpoint
    tensors: dict[str, tuple[int, int]]  # name -> (id, version) when from_pretrained returned


_records: "weakref.WeakKeyDictionary[nn.Module, list[_Loaded]]" = weakref.WeakKeyDictionary()
_active: list[list[_Loaded]] = []  # one list per open reading_deferred() block
_patch_lock = threading.RLock()


def _tensor_states(module: nn.Module) -> dict[str, tuple[int, int]]:
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return {name: (id(tensor), tensor._version) for name, tensor in named}


def local_folder(name_or_path: Any) -> str:
    """The local directory of a ``from_pretrained`` argument: a directory, or a model already in the
    Hugging Face cache (nothing is downloaded while a model is captured)."""
    path = os.fspath(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else None
    if path is None:
        raise CheckpointError(f"from_pretrained({name_or_path!r}): expected a directory or a model name")
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True, allow_patterns=["*.json", "*.safetensors"])
    except Exception:
        raise CheckpointError(f"from_pretrained({path!r}): not a local directory nor a model in the Hugging Face "
                              f"cache; download it first (hf download {path}) or pass its directory") from None


def _deferred_from_pretrained(cls, pretrained_model_name_or_path=None, *model_args, config=None, **kwargs):
    """``from_pretrained`` in a virtual build: the model from its config, its checkpoint recorded."""
    from transformers import AutoConfig

    folder = local_folder(pretrained_model_name_or_path)
    checkpoint = Checkpoint.open(folder)
    if config is None or isinstance(config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(config or folder)
    options = {key: kwargs[key] for key in ("dtype", "torch_dtype", "attn_implementation") if key in kwargs}
    for key in ("dtype", "torch_dtype"):
        if options.get(key) == "auto":  # the checkpoint's dtype: its config says it
            del options[key]
    model = cls._from_config(config, **options)
    model.eval()  # as from_pretrained returns it
    if _active:
        _active[-1].append(_Loaded(model, checkpoint, _tensor_states(model)))
    if kwargs.get("output_loading_info"):
        return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    return model


@contextlib.contextmanager
def reading_deferred() -> Iterator[list[_Loaded]]:
    """Within the block, ``from_pretrained`` of a Hugging Face model reads no weights when the build
    is virtual (:func:`is_virtual_build`); what it deferred is collected in the list the block
    yields (give it to :func:`note_loaded` with the model built inside)."""
    loaded: list[_Loaded] = []
    try:
        from transformers import PreTrainedModel
    except ImportError:  # no transformers: nothing calls from_pretrained
        yield loaded
        return
    with _patch_lock:
        original = PreTrainedModel.__dict__["from_pretrained"]

        def from_pretrained(cls, *args, **kwargs):
            if is_virtual_build():
                return _deferred_from_pretrained(cls, *args, **kwargs)
            return original.__func__(cls, *args, **kwargs)

        PreTrainedModel.from_pretrained = classmethod(from_pretrained)
        _active.append(loaded)
        try:
            yield loaded
        finally:
            _active.pop()
            PreTrainedModel.from_pretrained = original


def note_loaded(model: nn.Module, loaded: list[_Loaded]) -> None:
    """Keep what ``from_pretrained`` deferred while ``model`` was built (see :func:`checkpoint_names`)."""
    if loaded:
        _records[model] = list(loaded)


def record_checkpoint(model: nn.Module, checkpoint: Checkpoint) -> None:
    """``model`` (built virtually) stands for ``checkpoint``'s weights, as a deferred from_pretrained would say."""
    _records[model] = [_Loaded(model, checkpoint, _tensor_states(model))]


@dataclass
class PretrainedTensors:
    """Which tensors of a virtually built model come from a checkpoint."""

    stored: dict[str, tuple[Checkpoint, str]] = field(default_factory=dict)  # name -> (checkpoint, name there)
    edited: set[str] = field(default_factory=set)  # loaded, then replaced or changed by the model's code

    def owners(self) -> set[str]:
        """The modules holding such tensors (their other tensors are as the model's own build makes them)."""
        return {name.rpartition(".")[0] for name in list(self.stored) + list(self.edited)}


def checkpoint_names(model: nn.Module) -> PretrainedTensors:
    """Where the tensors of a virtually built ``model`` are stored (empty for a model whose weights
    are not pretrained). Tied names resolve to the stored one."""
    found = PretrainedTensors()
    for loaded in _records.get(model, []):
        prefix = next((name + "." if name else "" for name, module in model.named_modules(remove_duplicate=False)
                       if module is loaded.module), None)
        if prefix is None:  # loaded, then dropped by the factory
            continue
        named = list(loaded.module.named_parameters(remove_duplicate=False)) + \
            list(loaded.module.named_buffers(remove_duplicate=False))
        aliases: dict[int, list[str]] = {}
        for name, tensor in named:
            aliases.setdefault(id(tensor), []).append(name)
        for name, tensor in named:
            stored = next((alias for alias in aliases[id(tensor)] if alias in loaded.checkpoint), None)
            if stored is None:
                continue
            if loaded.tensors.get(name) != (id(tensor), tensor._version):
                found.edited.add(prefix + name)  # the factory's own value
            else:
                found.stored[prefix + name] = (loaded.checkpoint, stored)
    return found
