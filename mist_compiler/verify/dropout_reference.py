"""The reference run's dropout: the masks every plan draws (``ops.dropout``), on the eager model.

Capture rewrites each dropout site of the program that runs (``frontend.dropout_sites``): its mask
is a hash of the sample's seed, the layer, the site's number within its block (before the
layers, a layer, after the layers; in the order the code runs) and the element's position. The
one-process reference of ``--check`` runs the user's eager module instead, so it must draw the same
masks: :class:`DropoutReference` watches the module with a ``TorchFunctionMode`` (inside a
``with`` block only) that numbers its ``F.dropout`` / attention-dropout calls the same way, knowing
the running layer from hooks on the layer list, and gives each the counter-based mask. Plans and
reference then differ by rounding only, with or without dropout.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..frontend.layer_stack import LayerStackError, find_layer_stack
from ..ops.dropout import counter_attention, counter_dropout

_DROPOUTS = {F.dropout, torch.dropout}


class _Draw(TorchFunctionMode):
    def __init__(self, reference: "DropoutReference", seeds: torch.Tensor) -> None:
        super().__init__()
        self.reference, self.seeds = reference, seeds

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            named = {**dict(zip(("input", "p", "training", "inplace"), args)), **kwargs}
            p, training = float(named.get("p", 0.5)), bool(named.get("training", True))
            if p > 0 and training:
                return counter_dropout(named["input"], p, self.seeds, *self.reference.next_site())
        elif func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            named = {**dict(zip(names, args)), **kwargs}
            if float(named.get("dropout_p", 0.0)) > 0:
                layer, site = self.reference.next_site()
                return counter_attention(**named, seeds=self.seeds, layer=layer, site=site)
        return func(*args, **kwargs)


class DropoutReference:
    """Hooks on ``model``'s layer list that number its dropout sites as capture does (see the module
    docstring); :meth:`drawing` is the ``with`` block in which its dropout uses ``seeds``."""

    def __init__(self, model: nn.Module) -> None:
        try:
            layers = model.get_submodule(find_layer_stack(model, one_class=False).path)
        except LayerStackError:
            layers = nn.ModuleList()
        self.count = len(layers)
        self.layer, self.site = -1, 0
        self.handles = []
        for index, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(lambda *_, i=index: self._enter(i)))
            self.handles.append(layer.register_forward_hook(lambda *_: self._enter(self.count)))

    def _enter(self, layer: int) -> None:
        self.layer, self.site = layer, 0

    def next_site(self) -> tuple[int, int]:
        site, self.site = self.site, self.site + 1
        return self.layer, site

    @contextlib.contextmanager
    def drawing(self, seeds: torch.Tensor) -> Iterator[None]:
        self.layer, self.site = -1, 0
        with _Draw(self, seeds):
            yield

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


__all__ = ["DropoutReference"]
