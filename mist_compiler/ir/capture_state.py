"""What flows through the capture passes (``frontend/capture.py``): the model on its way from a
module or name to the captured program. Each pass returns a new state."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .model_graph import ModelGraph
from .program import MistProgram


@dataclass(frozen=True)
class CaptureState:
    """What flows through the capture passes; each pass returns a new state."""

    source: Any  # nn.Module or model name
    model_name: str
    attention: str
    dtype: str | None = None
    seq_len: int | None = None
    token_dtypes: tuple = (torch.long, torch.long)  # input_ids, labels
    model: Any = None  # the nn.Module with FakeTensor weights
    fake_mode: Any = None  # its FakeTensorMode
    config: dict | None = None
    layer_list: str | None = None  # module path of the nn.ModuleList of layers
    layer_groups: tuple = ()  # per kept layer: the original layer indices it stands for
    joint: Any = None  # frontend.joint.JointCapture: the joint forward+backward ATen graph
    shapes: dict | None = None
    partition: Any = None  # passes.block_discovery.BlockPartition
    program: MistProgram | None = None
    model_graph: ModelGraph | None = None
    max_positions: int | None = None
    analyse: bool = True  # False: only the torch-level program (no joint graph, no pricing)

    def __str__(self) -> str:
        if self.program is not None:
            from .printer import format_program
            return format_program(self.program)
        lines = [f"capture state of {self.model_name}: layer list {self.layer_list!r}, groups {list(self.layer_groups)}"]
        if self.joint is not None:
            lines.append(f"joint graph: {len(self.joint.joint_graph.graph.nodes)} nodes, "
                         f"{len(self.joint.saved_names)} saved values")
        if self.partition is not None:
            blocks = sorted(set(self.partition.node_block.values()))
            lines.append(f"blocks: {blocks}; layer hashes {self.partition.layer_hash}")
        return "\n".join(lines)
