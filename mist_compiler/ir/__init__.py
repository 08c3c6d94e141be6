"""The Mist IR: captured programs, blocks and symbolic shapes; the plan schema; (de)serialisation."""
from .plan import Offload, Plan, PlanError, StagePlan, load_plan, save_plan
from .program import (
    ATTENTION_KERNELS, B, S, SYMBOLS, T, AttentionInfo, Block, BlockClass, IRError, IRNode, MistProgram,
    SavedTensor, TensorInfo, attention_saved_tensors,
)

__all__ = ["Offload", "Plan", "PlanError", "StagePlan", "load_plan", "save_plan"]
__all__ += [
    "ATTENTION_KERNELS", "B", "S", "SYMBOLS", "T", "AttentionInfo", "Block", "BlockClass", "IRError", "IRNode",
    "MistProgram", "SavedTensor", "TensorInfo", "attention_saved_tensors",
]
