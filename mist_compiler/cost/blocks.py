"""What the stage cost model needs from one block class of a captured program (pre, layer, post).

Produced by :mod:`.analysis` (the analysis passes over the captured graphs), consumed by
:mod:`.stage_model` (which lambdifies and vectorises it).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..passes.cost_annotation import BlockCosts, GraphCosts
from ..passes.memory_analysis import BlockMemory
from .loss_kernel import LossShape

BLOCK_KINDS = ("pre", "layer", "post")


class StageModelError(ValueError):
    """Bad arguments to the stage cost model; the message names the field."""


@dataclass
class BlockAnalysis:
    """Everything the stage model needs from one block class, symbolic in b, s, t."""

    kind: str
    costs: BlockCosts
    memory: BlockMemory
    params_per_device: sympy.Expr  # parameter elements on one device under tensor parallelism
    params: int  # parameter elements, unsharded
    tp_granularity: int = 1  # tp must divide this (gcd of attention heads and sharded weight dims); 0: no sharding
    tp_optional: bool = False  # a degree that does not divide tp_granularity leaves the block whole (vocabulary)
    # per-device parameter elements of the backend's units in the block (modules owning parameters), forward
    # order; None: one unit
    units: list[sympy.Expr] | None = None
    # per-device elements of parameters the block reads and another block owns (a head tied to the embedding:
    # the runtime gathers the owner's unit for it, and autograd holds its gradient until the owner's backward)
    borrowed: sympy.Expr = sympy.Integer(0)
    # its memory where the stage lacks the post block, if the model shares a weight with it (cost.analysis)
    apart: BlockMemory | None = None
    loss: LossShape | None = None  # the fused head + loss it runs, if any (priced plain too: cost.loss_kernel)
    # the backward's weight half (``passes/weight_gradients``): its ops and the bytes it keeps from I to W
    weight_costs: GraphCosts | None = None
    weight_stash: sympy.Expr = sympy.Integer(0)
    sequence: "BlockAnalysis | None" = None  # the layer priced with sequence parallelism (None: not possible)
    tensors: object = None  # the layer's saved-tensor table (``passes.saved_tensors.LayerTensors``), if made
    # the layer as its eager program runs it, beside a compiled analysis: a unit with a per-tensor policy
    # runs eagerly (``lowering.compile``: its saved tensors are attributed node by node)
    eager: "BlockAnalysis | None" = None

    @property
    def tp_supported(self) -> bool:
        return self.costs.sharding.supported

    @property
    def tp_message(self) -> str:
        return self.costs.sharding.message
