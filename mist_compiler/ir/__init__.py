"""The Mist IR, data only: the captured program (blocks, classes, symbolic shapes), the model
graph the lowering cuts, a stage's lowered graph, the plan and its rank layout, the words every
part shares (:mod:`.vocabulary`). Imports nothing of the package above ``ir``.
"""
from .plan import Offload, Plan, PlanError, StagePlan, load_plan, save_plan
from .program import (
    ATTENTION_KERNELS,
    SYMBOLS,
    AttentionInfo,
    B,
    Block,
    BlockClass,
    IRError,
    IRNode,
    MistProgram,
    S,
    SavedTensor,
    T,
    TensorInfo,
    attention_saved_tensors,
)

__all__ = ["Offload", "Plan", "PlanError", "StagePlan", "load_plan", "save_plan"]
__all__ += [
    "ATTENTION_KERNELS", "B", "S", "SYMBOLS", "T", "AttentionInfo", "Block", "BlockClass", "IRError", "IRNode",
    "MistProgram", "SavedTensor", "TensorInfo", "attention_saved_tensors",
]
