"""Activation checkpointing: recompute the first ``ckpt_layers`` blocks of a stage in backward.

Each chosen ``call_module`` block node ``y = block(x)`` becomes
``y = checkpoint(block, x, use_reentrant=False)``: the block keeps its identity (its hooks still
fire, in forward and again during recomputation) and only its inputs are kept for backward.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch.fx as fx
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .manager import PassResult
from .partition import stage_interface


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
    """Wrap the first ``ckpt_layers`` layer blocks of the stage program."""

    ckpt_layers: int
    name: str = "checkpoint"

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        blocks = stage_interface(gm).block_targets
        if not 0 <= self.ckpt_layers <= len(blocks):
            raise CheckpointError(f"ckpt_layers={self.ckpt_layers} but the stage has {len(blocks)} layer blocks")
        if self.ckpt_layers == 0:
            return PassResult(gm, False)
        chosen = set(blocks[: self.ckpt_layers])
        graph = copy.deepcopy(gm.graph)
        for node in list(graph.nodes):
            if node.op == "call_module" and node.target in chosen:
                with graph.inserting_before(node):
                    module = graph.get_attr(node.target)
                node.op, node.target = "call_function", checkpoint_block
                node.args = (module, *node.args)
        rewritten = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
        rewritten.meta.update(gm.meta)
        rewritten.meta["mist_checkpointed"] = sorted(chosen)
        return PassResult(rewritten, True)
