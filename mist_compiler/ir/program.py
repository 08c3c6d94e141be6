"""The captured Mist program: blocks, block classes, ATen-level IR nodes with symbolic shapes.

A :class:`MistProgram` is what ``capture`` returns. The model is cut into blocks: one ``pre``
block (embeddings), the repeated ``layer`` blocks and one ``post`` block (final norm, head,
loss). Identical layers share a :class:`BlockClass` (same structural hash), analysed once.
Each class holds its forward and backward IR nodes (one per ATen op, shapes as sympy
expressions in the symbols ``b`` (micro-batch) and ``s`` (sequence)) and the tensors its forward
saves for backward. Attention is one IR op (``"attention"``) whatever SDPA kernel ran during
capture; what it saves depends on the *target* kernel (see :func:`attention_saved_tensors`).

Symbolic expressions serialise as strings (``sympy.srepr``-free ``str``) and parse back with
``sympy.sympify`` using the named symbols, so ``MistProgram.from_json(p.to_json())`` round-trips.
The live torch graphs (``BlockClass.graphs``) are attached for analysis passes but never
serialised.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import sympy

from .vocabulary import ATTENTION_KERNELS, DTYPE_BYTES, SYMBOLS, B, S, T

BLOCK_KINDS = ("pre", "layer", "post")


class IRError(ValueError):
    """Malformed IR input (bad JSON, unknown kernel, unknown class); the message names the field."""


def parse_expr(text: str | int) -> sympy.Expr:
    """Parse a serialised shape/size expression back into sympy with the IR's symbols."""
    if isinstance(text, int):
        return sympy.Integer(text)
    try:
        return sympy.sympify(text, locals=SYMBOLS)
    except (sympy.SympifyError, SyntaxError, TypeError) as error:
        raise IRError(f"cannot parse symbolic expression {text!r}: {error}") from None


def expr_str(expr: Any) -> str | int:
    expr = sympy.sympify(expr)
    return int(expr) if expr.is_Integer else str(expr)


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise IRError(f"dtype {dtype!r} has no known element size; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class TensorInfo:
    """Shape (sympy expressions in b, s) and dtype name (``"float16"``) of one tensor."""

    shape: tuple
    dtype: str

    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    def nbytes(self) -> sympy.Expr:
        return sympy.expand(self.numel() * dtype_bytes(self.dtype))

    def to_json(self) -> dict:
        return {"shape": [expr_str(d) for d in self.shape], "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: dict) -> "TensorInfo":
        return cls(tuple(parse_expr(d) for d in data["shape"]), data["dtype"])

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


@dataclass
class IRNode:
    """One ATen op (or the fused ``attention`` op) of a block, forward or backward phase."""

    name: str
    op: str
    inputs: list[str]
    outputs: list[TensorInfo]
    phase: str  # "forward" | "backward"
    attrs: dict = field(default_factory=dict)
    source: str = ""  # module path that issued the op, e.g. "blocks.0.attn.q"

    def to_json(self) -> dict:
        return {
            "name": self.name, "op": self.op, "inputs": list(self.inputs),
            "outputs": [o.to_json() for o in self.outputs], "phase": self.phase,
            "attrs": _jsonable(self.attrs), "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict) -> "IRNode":
        return cls(data["name"], data["op"], list(data["inputs"]),
                   [TensorInfo.from_json(o) for o in data["outputs"]], data["phase"],
                   dict(data.get("attrs", {})), data.get("source", ""))


@dataclass(frozen=True)
class SavedTensor:
    """A tensor the forward keeps for the backward, deduplicated by storage.

    ``kind`` is ``"activation"`` (counted in saved bytes), ``"input"`` (the block's input hidden
    state, counted: it is an activation of the previous block kept alive by this one) or
    ``"parameter"`` (a weight: not an activation, not counted). ``aliases`` names the other
    graph values that are views of the same storage.
    """

    name: str
    producer: str
    tensor: TensorInfo
    kind: str = "activation"
    aliases: tuple = ()

    def to_json(self) -> dict:
        return {"name": self.name, "producer": self.producer, "tensor": self.tensor.to_json(),
                "kind": self.kind, "aliases": list(self.aliases)}

    @classmethod
    def from_json(cls, data: dict) -> "SavedTensor":
        return cls(data["name"], data["producer"], TensorInfo.from_json(data["tensor"]),
                   data.get("kind", "activation"), tuple(data.get("aliases", ())))


@dataclass(frozen=True)
class AttentionInfo:
    """One attention op: the tensors a target kernel needs, independent of the captured kernel."""

    node: str
    captured_op: str
    query: TensorInfo  # [b, heads, s, head_dim]
    key: TensorInfo  # [b, kv_heads (after any repeat), s, head_dim]
    value: TensorInfo
    out: TensorInfo
    is_causal: bool = True
    dropout_p: float = 0.0

    @property
    def heads(self) -> sympy.Expr:
        return self.query.shape[1]

    def saved(self, kernel: str) -> list[tuple[str, TensorInfo]]:
        return attention_saved_tensors(self, kernel)

    def to_json(self) -> dict:
        return {"node": self.node, "captured_op": self.captured_op, "query": self.query.to_json(),
                "key": self.key.to_json(), "value": self.value.to_json(), "out": self.out.to_json(),
                "is_causal": self.is_causal, "dropout_p": self.dropout_p}

    @classmethod
    def from_json(cls, data: dict) -> "AttentionInfo":
        return cls(data["node"], data["captured_op"], TensorInfo.from_json(data["query"]),
                   TensorInfo.from_json(data["key"]), TensorInfo.from_json(data["value"]),
                   TensorInfo.from_json(data["out"]), bool(data.get("is_causal", True)),
                   float(data.get("dropout_p", 0.0)))


def attention_saved_tensors(attn: AttentionInfo, kernel: str) -> list[tuple[str, TensorInfo]]:
    """What the target attention kernel keeps for its backward.

    ``flash``: q, k, v, out and the fp32 log-sum-exp [b, heads, s].
    ``math``: q, k, v, out and the [b, heads, s, s] softmax probabilities (the softmax output is
    what both the softmax backward and the probs @ v backward read); with dropout, also the
    dropped-out probabilities. No log-sum-exp.
    """
    if kernel not in ATTENTION_KERNELS:
        raise IRError(f"attention kernel {kernel!r} is unknown; choose one of {list(ATTENTION_KERNELS)}")
    base = [("query", attn.query), ("key", attn.key), ("value", attn.value), ("out", attn.out)]
    batch, heads, seq_q = attn.query.shape[0], attn.query.shape[1], attn.query.shape[2]
    seq_k = attn.key.shape[2]
    if kernel == "flash":
        return base + [("logsumexp", TensorInfo((batch, heads, seq_q), "float32"))]
    probs = TensorInfo((batch, heads, seq_q, seq_k), attn.query.dtype)
    extra = [("probs", probs)]
    if attn.dropout_p > 0:
        extra.append(("dropped_probs", probs))
    return base + extra


@dataclass
class BlockClass:
    """Identical blocks share one class: analysed once from a representative block."""

    class_id: int
    kind: str
    structural_hash: str
    representative: str  # module path of the block that was analysed
    param_count: int
    param_shapes: dict  # local parameter name -> tuple of ints
    param_dtype: str
    forward_nodes: list[IRNode] = field(default_factory=list)
    backward_nodes: list[IRNode] = field(default_factory=list)
    # as captured, minus the storages the attention kernel model accounts for (its q, k, v, out...)
    saved: list[SavedTensor] = field(default_factory=list)
    attention: list[AttentionInfo] = field(default_factory=list)
    graphs: dict = field(default_factory=dict, repr=False, compare=False)  # live torch graphs, not serialised
    # values the nodes read but do not produce (weights, the block input, other blocks' values)
    inputs: dict = field(default_factory=dict)  # name -> TensorInfo
    sizes: dict = field(default_factory=dict)  # name -> sympy expr of size values read (b, s, b*s ...)
    outputs: dict = field(default_factory=dict)  # name -> TensorInfo of forward values later blocks read

    def tensor(self, name: str) -> TensorInfo | None:
        """Shape/dtype of any value a node of this class produces or reads (first output for multi-output ops)."""
        if name in self.inputs:
            return self.inputs[name]
        for node in self.forward_nodes + self.backward_nodes:
            if node.name == name:
                return node.outputs[0] if node.outputs else None
        return None

    def saved_tensors(self, attention: str = "flash") -> list[tuple[str, TensorInfo]]:
        """Tensors kept for backward by one micro-batch, for the given target attention kernel."""
        kept = [(t.name, t.tensor) for t in self.saved if t.kind != "parameter"]
        for attn in self.attention:
            for role, info in attn.saved(attention):
                kept.append((f"{attn.node}.{role}", info))
        return kept

    def saved_bytes_expr(self, attention: str = "flash") -> sympy.Expr:
        total = sum((info.nbytes() for _, info in self.saved_tensors(attention)), sympy.Integer(0))
        return sympy.expand(total)

    def to_json(self) -> dict:
        return {
            "class_id": self.class_id, "kind": self.kind, "structural_hash": self.structural_hash,
            "representative": self.representative, "param_count": self.param_count,
            "param_shapes": {k: list(v) for k, v in self.param_shapes.items()},
            "param_dtype": self.param_dtype,
            "forward_nodes": [n.to_json() for n in self.forward_nodes],
            "backward_nodes": [n.to_json() for n in self.backward_nodes],
            "saved": [t.to_json() for t in self.saved],
            "attention": [a.to_json() for a in self.attention],
            "inputs": {k: v.to_json() for k, v in self.inputs.items()},
            "sizes": {k: expr_str(v) for k, v in self.sizes.items()},
            "outputs": {k: v.to_json() for k, v in self.outputs.items()},
        }

    @classmethod
    def from_json(cls, data: dict) -> "BlockClass":
        return cls(
            data["class_id"], data["kind"], data["structural_hash"], data["representative"],
            data["param_count"], {k: tuple(v) for k, v in data["param_shapes"].items()},
            data["param_dtype"],
            [IRNode.from_json(n) for n in data["forward_nodes"]],
            [IRNode.from_json(n) for n in data["backward_nodes"]],
            [SavedTensor.from_json(t) for t in data["saved"]],
            [AttentionInfo.from_json(a) for a in data["attention"]],
            {}, {k: TensorInfo.from_json(v) for k, v in data.get("inputs", {}).items()},
            {k: parse_expr(v) for k, v in data.get("sizes", {}).items()},
            {k: TensorInfo.from_json(v) for k, v in data.get("outputs", {}).items()},
        )


@dataclass(frozen=True)
class Block:
    """One block of the model. Layers are indexed 0..L-1; pre is -1 and post is L."""

    index: int
    kind: str
    module_path: str
    class_id: int
    param_count: int

    def to_json(self) -> dict:
        return {"index": self.index, "kind": self.kind, "module_path": self.module_path,
                "class_id": self.class_id, "param_count": self.param_count}

    @classmethod
    def from_json(cls, data: dict) -> "Block":
        return cls(data["index"], data["kind"], data["module_path"], data["class_id"], data["param_count"])


@dataclass
class MistProgram:
    """A captured model: its blocks, their classes and the symbols shapes are written in."""

    model_name: str
    blocks: list[Block]
    block_classes: dict  # class_id -> BlockClass
    dtype: str
    attention: str = "flash"  # the default target attention kernel
    seq_len: int = 2048  # default value of s (the model's max sequence length)
    symbols: tuple = ("b", "s")
    config: dict = field(default_factory=dict)
    captured_attention_ops: tuple = ()
    max_positions: int | None = None  # the longest sequence the model takes (its position table), if bounded
    # the torch-level program the lowering passes cut and the runtime executes (live, not serialised)
    model_graph: Any = field(default=None, repr=False, compare=False)
    # what the analysis passes found (``passes.cost_annotation.PricedGraphs``: graphs, costs, memory per
    # block class); None until priced (live, not serialised)
    analysis: Any = field(default=None, repr=False, compare=False)

    @property
    def params(self) -> int:
        return sum(block.param_count for block in self.blocks)

    @property
    def layers(self) -> list[Block]:
        return [block for block in self.blocks if block.kind == "layer"]

    def block_class(self, class_id: int) -> BlockClass:
        if class_id not in self.block_classes:
            raise IRError(f"block class {class_id} does not exist; classes: {sorted(self.block_classes)}")
        return self.block_classes[class_id]

    def saved_bytes_expr(self, class_id: int, attention: str | None = None) -> sympy.Expr:
        return self.block_class(class_id).saved_bytes_expr(attention or self.attention)

    def saved_bytes(self, class_id: int, b: int, s: int | None = None, attention: str | None = None) -> int:
        expr = self.saved_bytes_expr(class_id, attention)
        return int(expr.subs({B: b, S: self.seq_len if s is None else s}))

    def to_json(self) -> dict:
        return {
            "format": "mist-ir/1", "model_name": self.model_name, "dtype": self.dtype,
            "attention": self.attention, "seq_len": self.seq_len, "symbols": list(self.symbols),
            "config": _jsonable(self.config), "captured_attention_ops": list(self.captured_attention_ops),
            "max_positions": self.max_positions,
            "blocks": [b.to_json() for b in self.blocks],
            "block_classes": [c.to_json() for c in self.block_classes.values()],
        }

    def dumps(self, **kwargs) -> str:
        return json.dumps(self.to_json(), **kwargs)

    @classmethod
    def from_json(cls, data: dict | str) -> "MistProgram":
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as error:
                raise IRError(f"Mist IR JSON is not valid JSON: {error}") from None
        if not isinstance(data, dict) or data.get("format") != "mist-ir/1":
            raise IRError("Mist IR JSON: field 'format' must be 'mist-ir/1'")
        try:
            classes = [BlockClass.from_json(c) for c in data["block_classes"]]
            return cls(
                data["model_name"], [Block.from_json(b) for b in data["blocks"]],
                {c.class_id: c for c in classes}, data["dtype"], data.get("attention", "flash"),
                data.get("seq_len", 2048), tuple(data.get("symbols", ("b", "s"))),
                dict(data.get("config", {})), tuple(data.get("captured_attention_ops", ())),
                data.get("max_positions"),
            )
        except KeyError as error:
            raise IRError(f"Mist IR JSON: missing field {error}") from None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, sympy.Basic):
        return expr_str(value)
    return str(value)
