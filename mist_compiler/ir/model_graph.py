"""The model as the torch-level program capture traced: what the lowering passes cut and run.

Capture traces the model once (dynamo, one layer per group of identical layers). The ATen joint
graph of that trace is what the cost model prices; its torch-level graph, described here, is
what the lowering passes partition into pipeline stages, shard over tensor-parallel ranks and
checkpoint, and what the runtime executes. A layer of the full model runs its group
representative's region of this graph with its own parameters, so every layer runs the program
that was analysed.

Regions of the graph (node names): ``pre`` (before the first layer: embeddings and the glue the
layers share, e.g. rotary tables and masks), one :class:`LayerRegion` per traced layer, and
``post`` (final norm, head, loss). Live torch graphs are kept here and never serialised.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

PARAMETER, BUFFER, CONSTANT = "parameter", "buffer", "constant"  # kinds of tensors a graph reads
DROPOUT_SEEDS = "dropout_seeds"  # the batch input of per-sample dropout seeds (``ops.dropout``), fed by the runtime
LAYER_CONSTANT = "mist_layer_{}"  # attribute of the captured graph module holding a layer's index (0-d int64)


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split over the tensor-parallel group.

    ``dim`` is the split dimension; ``segments`` (fused projections such as GPT-2's c_attn) are
    the sizes of the parts along ``dim`` that are split separately and concatenated per rank.
    """

    dim: int
    segments: tuple[int, ...] = ()

    def rank_slices(self, size: int, rank: int, world: int) -> list[slice]:
        """The slices of ``dim`` this rank keeps, in order."""
        parts = self.segments or (size,)
        if sum(parts) != size:
            raise ValueError(f"shard segments {parts} do not add up to the dimension's size {size}")
        slices, start = [], 0
        for part in parts:
            if part % world:
                raise ValueError(f"a part of size {part} is not divisible by the tensor-parallel degree {world}")
            piece = part // world
            slices.append(slice(start + rank * piece, start + (rank + 1) * piece))
            start += part
        return slices


@dataclass(frozen=True)
class GraphEdit:
    """A rewrite the tensor-parallel lowering applies to one node of the torch-level graph."""

    node: str
    kind: str  # "divide_arg": a size argument divided by t; "divide_slice": a slice's bounds divided by t;
    # "copy_in": all-reduce the gradient of the value where the nodes named in ``data`` read it;
    # "reduce_out" / "reduce_mean": all-reduce a partial sum (a mean: divided by t), ``data`` the biases
    # added after it; "scatter": the value read as this rank's part by ``data[0]`` (``position``: dim and
    # the entries of one block along it; ``data[1]``: parts split separately); "tp_norm": a norm over
    # split features; "split_dropout": dropout of a split value (``position``: dim, block; ``data``: parts);
    # "vocab_embedding"; "vocab_loss"; "vocab_fused_loss"; "defer_bias"
    position: tuple = ()  # where in the node's arguments (e.g. (1,) or (1, 2) for a nested list)
    data: tuple = ()


@dataclass
class RegionSharding:
    """The tensor-parallel decision for one region: parameter splits and graph edits."""

    shards: dict[str, ShardSpec] = field(default_factory=dict)  # placeholder name -> split
    edits: list[GraphEdit] = field(default_factory=list)
    replicated: dict[str, str] = field(default_factory=dict)  # weight placeholder -> why it is not split


@dataclass
class TensorParallelPlan:
    """Outcome of the tensor-parallel recognition (one recogniser, used by pricing and lowering)."""

    supported: bool
    reason: str = ""  # why not, naming the layer and the op
    regions: dict[str, RegionSharding] = field(default_factory=dict)  # "pre" | "post" | "layer:<traced>"
    granularity: int = 0  # gcd of the sizes sharded: t must divide it

    def sharded_placeholders(self) -> set[str]:
        return {name for region in self.regions.values() for name in region.shards}


@dataclass
class SequenceRegion:
    """Sequence parallelism in one layer region: where its tensor-parallel edges become sequence
    collectives, and the sequence dimension of each value there."""

    hidden_dim: int  # the sequence dimension of the hidden state entering and leaving the layer
    gathers: dict[str, int] = field(default_factory=dict)  # copy_in value -> its sequence dim (all-gather)
    scatters: dict[str, int] = field(default_factory=dict)  # reduce_out value -> its sequence dim (reduce-scatter)
    split_values: tuple[str, ...] = ()  # nodes whose values are split along the sequence (for pricing and display)


@dataclass
class SequenceParallelPlan:
    """Outcome of the sequence-parallel recognition (``passes/sp_recognition``): whether the layers'
    code between their tensor-parallel regions works token by token, so it can run on a chunk of the
    sequence, and the edges to rewrite; or why not, naming the layer, the op and the source line."""

    supported: bool
    reason: str = ""
    regions: dict[str, SequenceRegion] = field(default_factory=dict)  # "layer:<traced>" -> its edges


@dataclass(frozen=True)
class LayerRegion:
    """One traced layer: its nodes and the values crossing its edges."""

    traced: int  # index of the layer in the traced (reduced) layer list
    layers: tuple[int, ...]  # indices in the real model of the layers this one stands for
    nodes: tuple[str, ...]  # its nodes in graph order (no placeholders)
    carried_in: str  # the hidden state entering it
    carried_out: str  # the hidden state leaving it
    glue: tuple[str, ...]  # other outside values it reads (shared tables, masks, sizes), in order
    params: dict[str, str]  # placeholder -> path inside the layer ("self_attn.q_proj.weight")
    hidden_users: frozenset = frozenset()  # its nodes reading carried_in as the hidden state (not as glue)

    @property
    def label(self) -> str:
        return f"layer:{self.traced}"


@dataclass
class ModelGraph:
    """The torch-level program of a captured model and its regions."""

    graph: torch.fx.GraphModule
    layer_list: str  # module path of the layer list ("model.layers")
    num_layers: int
    regions: list[LayerRegion]  # in graph order
    pre: tuple[str, ...]  # node names (no placeholders) before the first layer
    post: tuple[str, ...]  # node names after the last layer
    tensors: dict[str, tuple[str, str]]  # placeholder -> (PARAMETER | BUFFER, name in the real model)
    batch_inputs: dict[str, str]  # placeholder -> "input_ids" | "labels"
    sizes: dict[str, tuple[str, int]]  # SymInt placeholder -> (batch input, dimension)
    tp: TensorParallelPlan | None = None  # set by the tensor-parallel recognition pass
    sp: SequenceParallelPlan | None = None  # set by the sequence-parallel recognition pass
    primals: dict[str, str] = field(default_factory=dict)  # ATen joint placeholder -> this graph's placeholder
    layer_index: str | None = None  # placeholder of the running layer's index (read by its dropout sites)

    def sharded_primals(self) -> set[str]:
        """The joint graph's placeholders of the parameters the tensor-parallel plan splits."""
        if self.tp is None or not self.tp.supported:
            return set()
        split = self.tp.sharded_placeholders()
        return {primal for primal, source in self.primals.items() if source in split}

    def region_of_layer(self, layer: int) -> LayerRegion:
        for region in self.regions:
            if layer in region.layers:
                return region
        raise KeyError(f"layer {layer} is not in the traced program (0..{self.num_layers - 1})")

    def layer_fqn(self, layer: int, path: str) -> str:
        return f"{self.layer_list}.{layer}.{path}" if self.layer_list else f"{layer}.{path}"

    def node(self, name: str) -> torch.fx.Node:
        return self._by_name()[name]

    def tied_parameters(self) -> set[str]:
        """Names (in the model) of the parameters both the pre part (embedding) and the post part
        (head) read: the weights a pipeline must keep tied."""
        by_name = self._by_name()

        def read_by(nodes: tuple[str, ...]) -> set[str]:
            return {a.name for n in nodes for a in by_name[n].all_input_nodes
                    if self.tensors.get(a.name, ("", ""))[0] == PARAMETER}

        return {self.tensors[p][1] for p in read_by(self.pre) & read_by(self.post)}

    def _by_name(self) -> dict[str, torch.fx.Node]:
        cache = getattr(self, "_nodes", None)
        if cache is None or len(cache) != len(self.graph.graph.nodes):
            cache = {n.name: n for n in self.graph.graph.nodes}
            object.__setattr__(self, "_nodes", cache)
        return cache
