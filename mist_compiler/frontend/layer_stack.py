"""Finding a model's layer stack: the largest ``nn.ModuleList`` of same-class children.

The pipeline cuts between the blocks of that list; every other module with parameters belongs
to the "pre" block (used before the first layer) or the "post" block (used after the last).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class LayerStackError(ValueError):
    """The model has no recognisable stack of identical layer blocks."""


@dataclass(frozen=True)
class LayerStack:
    path: str  # dotted path of the ModuleList inside the model ("blocks", "model.layers")
    blocks: nn.ModuleList

    def __len__(self) -> int:
        return len(self.blocks)

    def block_path(self, index: int) -> str:
        return f"{self.path}.{index}" if self.path else str(index)


def find_layer_stack(model: nn.Module, *, one_class: bool = True) -> LayerStack:
    """The largest ModuleList whose children all have one class (ties: the first found).

    ``one_class=False`` accepts lists of mixed layer classes too (capture groups such layers by
    structure itself); the pipeline needs the default.
    """
    best: LayerStack | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if one_class and len({type(child) for child in module}) != 1:
            continue
        if best is None or len(module) > len(best.blocks):
            best = LayerStack(path, module)
    if best is None:
        raise LayerStackError(
            f"{type(model).__name__} has no nn.ModuleList of identical layer blocks; "
            "the pipeline needs its layers in one ModuleList (block(x) -> x)"
        )
    return best
