"""Activation checkpointing: recompute the first ``ckpt_layers`` layers of a stage in backward.

On a :class:`~mist_compiler.ir.stage.StageGraph`, each chosen layer call ``y = layer(x, *glue)``
becomes ``y = checkpoint_block(layer, x, *glue)`` (non-reentrant ``torch.utils.checkpoint``): the
unit keeps its identity (its hooks still fire, in forward and again during recomputation) and
only its inputs are kept for backward. The first layers are chosen, as the cost model assumes
(they are the ones whose activations live longest in a 1F1B schedule).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch.fx as fx
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ..ir.stage import StageGraph
from .manager import PassResult
from .tp_sharding import clone_graph


class CheckpointError(ValueError):
    """A checkpoint request the stage cannot satisfy."""


def checkpoint_block(block, *args, **kwargs):
    """Run ``block`` under non-reentrant activation checkpointing.

    Early stopping is off: the recomputation runs the block's forward to its end, so module
    hooks (the runtime's weight gathering and release) always fire in pairs.
    """
    with set_checkpoint_early_stop(False):
        return checkpoint(block, *args, use_reentrant=False, **kwargs)


@dataclass
class ActivationCheckpoint:
    """Wrap the first ``ckpt_layers`` layer units of the stage."""

    ckpt_layers: int
    name: str = "checkpoint"
    input_type = output_type = StageGraph

    def __call__(self, stage: StageGraph) -> PassResult:
        layers = stage.layer_units
        if not 0 <= self.ckpt_layers <= len(layers):
            raise CheckpointError(f"ckpt_layers={self.ckpt_layers} but stage {stage.stage} has {len(layers)} layers")
        if self.ckpt_layers == 0:
            return PassResult(stage, False)
        chosen = {unit.name for unit in layers[: self.ckpt_layers]}
        graph = clone_graph(stage.graph)
        for node in list(graph.nodes):
            if node.op == "call_module" and node.target in chosen:
                with graph.inserting_before(node):
                    module = graph.get_attr(node.target)
                node.op, node.target = "call_function", checkpoint_block
                node.args = (module, *node.args)
        units = [replace(u, checkpointed=u.name in chosen) for u in stage.units]
        return PassResult(replace(stage, graph=graph, units=units), True)
