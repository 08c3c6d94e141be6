"""The Plan: how to train one model on one cluster (DESIGN.md section 3).

A stable JSON/YAML schema. Loading validates every field and names the one that is wrong;
unknown keys are rejected. ``layers`` is a half-open range of layer-block indices; the
embedding (pre) block belongs to the first stage and the head/loss (post) block to the last.
``micro_batch`` is per data-parallel rank, and for every stage
``global_batch == micro_batch * dp * grad_accum``. A stage runs on ``nodes * gpus_per_node``
devices, which must equal ``dp * tp``.

``grad_dtype`` (optional, default ``"float32"``) is the dtype of the gradients a stage keeps
between micro-batches and until the optimizer step under ZeRO 0-1: ``"float32"`` accumulates
and reduces in fp32; the plan's own ``dtype`` (fp16/bf16, as Mist and Megatron keep them) halves
that memory: autograd accumulates each micro-batch into the param-dtype buffer (fp32 arithmetic,
one rounding per micro-batch), the data-parallel reduction still runs in fp32. ZeRO 2-3 keep
their ``1/dp`` accumulator shard in fp32 either way, and so does a ZeRO 0-1 stage that offloads
gradients (its fp32 accumulator is split with the host).

``compiled`` (optional, default ``ir.vocabulary.COMPILED_DEFAULT``) says whether every unit runs as
code compiled by inductor (fused elementwise kernels, what its partitioner saves for the backward)
or op by op in eager mode; the cost model prices the one the plan names and the runtime runs it
(``--no-compile`` runs a compiled plan eagerly, for debugging).

``fused_loss`` (optional, default ``true``: what plans written before the key meant) is how the last
stage computes its LM head and loss. ``true``: the fused, chunked ``mist::linear_cross_entropy``
(no ``N x V`` logits exist; the backward recomputes them chunk by chunk: ``8NHV`` FLOPs instead of
``6NHV``). ``false``: the head's logits are materialised and the loss runs as the model wrote it,
which is faster and holds about ``N x V`` fp32 values more (``N`` tokens of a micro-batch, ``V``
the vocabulary on one device). The tuner writes ``false`` where that fits in memory.

``schedule`` (optional, default ``"1f1b"``) names the pipeline schedule (:mod:`.schedule`:
``1f1b``, ``gpipe``, ``interleaved``, ``zb-h1``, ``zbv``) and ``virtual_stages`` (optional,
default 1) how many pipeline stages share one group of devices. With ``v`` virtual stages,
``stages`` lists the ``pp * v`` virtual stages in pipeline order (contiguous layers, as ever) and
virtual stage ``j`` runs on the devices of stage ``placement[j]`` (round-robin ``j % pp``;
``zbv``: a V, the last stage back on the first devices); the first ``pp`` entries are the device
groups, and a later entry repeats its group's ``nodes``, ``gpus_per_node``, ``dp``, ``tp``,
``micro_batch`` and ``zero`` (its layers, checkpointing and offload are its own).

``sp`` (optional per stage, default ``false``): sequence parallelism with the stage's tensor
parallelism (``tp > 1``, the sequence length divisible by ``tp``): the values between the
tensor-parallel regions of each layer (norms, residual adds, dropout) are split along the sequence
over the ``tp`` ranks, and the stage's pipeline boundaries carry sequence chunks where the
neighbouring stage uses the same ``tp`` with ``sp``.

``activations`` (optional per stage, default: none): per-tensor choices for the stage's layers that
are not checkpointed, ``{"recompute": [node, ...], "offload": {node: fraction}}``: the nodes of the
layer's program (names as ``mistc ir`` prints them) whose saved tensors are dropped in the forward
and recomputed in the backward by running the node again, and the fraction of each node's saved
bytes kept in host memory. ``offload.acts`` then applies to the checkpointed layers only (their
inputs); the names are checked against the model before anything runs.
"""
from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from .files import write_atomic
from .schedule import DEFAULT_SCHEDULE, SCHEDULES, placement, schedule_problem
from .vocabulary import COMPILED_DEFAULT, OFFLOAD_KINDS, TRAINING_DTYPES


class PlanError(ValueError):
    """A plan that is malformed or inconsistent; the message names the field."""


def _require(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise PlanError(f"plan field {where}: {message}")


def _check_keys(data: Any, cls: type, where: str) -> None:
    _require(isinstance(data, dict), where, f"expected an object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    _require(not unknown, where, f"unknown key(s) {unknown}; allowed: {sorted(known)}")
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing = sorted(required - set(data))
    _require(not missing, where, f"missing key(s) {missing}")


MAX_INT = 2**31 - 1  # no size, count or layer index of a real plan comes near it; tensor sizes overflow past 2**63


def _int(value: Any, where: str, minimum: int = 0) -> int:
    _require(isinstance(value, int) and not isinstance(value, bool), where, f"expected an integer, got {value!r}")
    _require(value >= minimum, where, f"must be >= {minimum}, got {value}")
    _require(value <= MAX_INT, where, f"must be at most {MAX_INT}, got {value}")
    return value


def _bool(value: Any, where: str) -> bool:
    _require(isinstance(value, bool), where, f"expected true or false, got {value!r}")
    return value


def _ratio(value: Any, where: str) -> float:
    _require(isinstance(value, (int, float)) and not isinstance(value, bool), where, f"expected a number, got {value!r}")
    _require(0.0 <= float(value) <= 1.0, where, f"must be in [0, 1], got {value}")
    return float(value)


@dataclass(frozen=True)
class Offload:
    """Fractions (0..1) of each kind of state kept in host memory instead of on the device."""

    weights: float = 0.0
    grads: float = 0.0
    opt: float = 0.0
    acts: float = 0.0

    def __post_init__(self) -> None:
        for kind in OFFLOAD_KINDS:
            _ratio(getattr(self, kind), f"offload.{kind}")

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "Offload":
        _check_keys(data, cls, where)
        return cls(**{key: _ratio(value, f"{where}.{key}") for key, value in data.items()})

    @property
    def any(self) -> bool:
        return any(getattr(self, kind) > 0 for kind in OFFLOAD_KINDS)


@dataclass(frozen=True)
class ActivationPolicy:
    """Per-tensor keep / recompute / offload for a stage's layers (see the module docstring)."""

    recompute: tuple[str, ...] = ()
    offload: tuple[tuple[str, float], ...] = ()  # (node, fraction of its saved bytes on the host), by node

    def __post_init__(self) -> None:
        for node, fraction in self.offload:
            _ratio(fraction, f"activations.offload.{node}")

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "ActivationPolicy":
        _check_keys(data, cls, where)
        recompute = data.get("recompute", [])
        _require(isinstance(recompute, list) and all(isinstance(n, str) and n for n in recompute),
                 f"{where}.recompute", f"expected a list of node names, got {recompute!r}")
        _require(len(set(recompute)) == len(recompute), f"{where}.recompute", "names a node twice")
        offload = data.get("offload", {})
        _require(isinstance(offload, dict), f"{where}.offload", f"expected an object node -> fraction, got {offload!r}")
        fractions = tuple(sorted((str(node), _ratio(value, f"{where}.offload.{node}")) for node, value in offload.items()))
        both = sorted(set(recompute) & {node for node, _ in fractions})
        _require(not both, f"{where}.offload", f"{both} are recomputed: their saved tensors are not kept to offload")
        return cls(tuple(recompute), tuple((node, value) for node, value in fractions if value > 0))

    def to_dict(self) -> dict:
        return {"recompute": list(self.recompute), "offload": dict(self.offload)}

    @property
    def offload_fractions(self) -> dict[str, float]:
        return dict(self.offload)

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.recompute + tuple(node for node, _ in self.offload)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its layer range, devices and memory/parallelism choices."""

    layers: tuple[int, int]
    nodes: int
    gpus_per_node: int
    micro_batch: int
    dp: int
    tp: int
    zero: int = 0
    ckpt_layers: int = 0
    offload: Offload = field(default_factory=Offload)
    sp: bool = False  # sequence parallelism with the stage's tensor parallelism (module docstring)
    activations: ActivationPolicy | None = None  # per-tensor choices for the layers not checkpointed

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "StagePlan":
        _check_keys(data, cls, where)
        layers = data["layers"]
        _require(
            isinstance(layers, (list, tuple)) and len(layers) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in layers),
            f"{where}.layers", f"expected [start, end] integers, got {layers!r}",
        )
        start, end = layers
        _require(0 <= start < end <= MAX_INT, f"{where}.layers", f"need 0 <= start < end <= {MAX_INT}, got [{start}, {end}]")
        stage = cls(
            layers=(start, end),
            nodes=_int(data["nodes"], f"{where}.nodes", 1),
            gpus_per_node=_int(data["gpus_per_node"], f"{where}.gpus_per_node", 1),
            micro_batch=_int(data["micro_batch"], f"{where}.micro_batch", 1),
            dp=_int(data["dp"], f"{where}.dp", 1),
            tp=_int(data["tp"], f"{where}.tp", 1),
            zero=_int(data.get("zero", 0), f"{where}.zero", 0),
            ckpt_layers=_int(data.get("ckpt_layers", 0), f"{where}.ckpt_layers", 0),
            offload=Offload.from_dict(data.get("offload", {}), f"{where}.offload"),
            sp=_bool(data.get("sp", False), f"{where}.sp"),
            activations=ActivationPolicy.from_dict(data["activations"], f"{where}.activations")
            if data.get("activations") is not None else None,
        )
        _require(not stage.sp or stage.tp > 1, f"{where}.sp",
                 f"sequence parallelism splits the sequence over the tensor-parallel ranks: it needs tp > 1, got tp = {stage.tp}")
        _require(stage.zero <= 3, f"{where}.zero", f"ZeRO level must be 0..3, got {stage.zero}")
        _require(
            stage.dp * stage.tp == stage.devices, f"{where}.dp",
            f"dp * tp = {stage.dp} * {stage.tp} = {stage.dp * stage.tp} must equal the stage's devices "
            f"nodes * gpus_per_node = {stage.nodes} * {stage.gpus_per_node} = {stage.devices}",
        )
        _require(
            stage.ckpt_layers <= stage.num_layers, f"{where}.ckpt_layers",
            f"{stage.ckpt_layers} checkpointed layers but the stage has {stage.num_layers}",
        )
        return stage

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layers"] = list(self.layers)
        if not self.sp:  # optional keys at their defaults are left out: older plans keep their schema
            del data["sp"]
        if self.activations is None:
            del data["activations"]
        else:
            data["activations"] = self.activations.to_dict()
        return data


@dataclass(frozen=True)
class Plan:
    """A whole training plan; see the module docstring for the invariants."""

    model: str
    seq_len: int
    global_batch: int
    dtype: str
    grad_accum: int
    stages: tuple[StagePlan, ...]
    grad_dtype: str = "float32"
    compiled: bool = COMPILED_DEFAULT
    fused_loss: bool = True
    schedule: str = DEFAULT_SCHEDULE
    virtual_stages: int = 1

    @property
    def low_precision_grads(self) -> bool:
        """ZeRO 0-1 stages keep their gradients in the param dtype (``grad_dtype`` is not fp32)."""
        return self.grad_dtype != "float32"

    @property
    def num_layers(self) -> int:
        return self.stages[-1].layers[1]

    @property
    def world_size(self) -> int:
        return sum(stage.devices for stage in self.physical_stages)

    @property
    def pp(self) -> int:
        """Physical pipeline stages (groups of devices)."""
        return len(self.stages) // self.virtual_stages

    @property
    def physical_stages(self) -> tuple[StagePlan, ...]:
        """One entry per group of devices (virtual stage ``s < pp`` runs on group ``s``)."""
        return self.stages[:self.pp]

    @property
    def placement(self) -> tuple[int, ...]:
        """The physical stage each virtual stage (entry of ``stages``) runs on."""
        return placement(self.schedule, self.pp, self.virtual_stages)

    def chunks(self, stage: int) -> list[int]:
        """The virtual stages physical stage ``stage`` runs, in pipeline order."""
        return [j for j, where in enumerate(self.placement) if where == stage]

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        _check_keys(data, cls, "<plan>")
        _require(isinstance(data["model"], str) and data["model"], "model", "expected a non-empty string")
        _require(data["dtype"] in TRAINING_DTYPES, "dtype", f"must be one of {list(TRAINING_DTYPES)}, got {data['dtype']!r}")
        stages_data = data["stages"]
        _require(isinstance(stages_data, list) and stages_data, "stages", "expected a non-empty list")
        plan = cls(
            model=data["model"],
            seq_len=_int(data["seq_len"], "seq_len", 1),
            global_batch=_int(data["global_batch"], "global_batch", 1),
            dtype=data["dtype"],
            grad_accum=_int(data["grad_accum"], "grad_accum", 1),
            stages=tuple(StagePlan.from_dict(s, f"stages[{i}]") for i, s in enumerate(stages_data)),
            grad_dtype=data.get("grad_dtype", "float32"),
            compiled=data.get("compiled", COMPILED_DEFAULT),
            fused_loss=data.get("fused_loss", True),
            schedule=data.get("schedule", DEFAULT_SCHEDULE),
            virtual_stages=_int(data.get("virtual_stages", 1), "virtual_stages", 1),
        )
        plan._check_consistency()
        return plan

    def _check_consistency(self) -> None:
        _require(isinstance(self.fused_loss, bool), "fused_loss", f"expected true or false, got {self.fused_loss!r}")
        _require(self.grad_dtype in ("float32", self.dtype), "grad_dtype",
                 f"must be 'float32' or the plan's dtype {self.dtype!r}, got {self.grad_dtype!r}")
        _require(isinstance(self.compiled, bool), "compiled", f"expected true or false, got {self.compiled!r}")
        self._check_schedule()
        expected_start = 0
        for index, stage in enumerate(self.stages):
            where = f"stages[{index}]"
            _require(
                stage.layers[0] == expected_start, f"{where}.layers",
                f"stages must cover the layers contiguously: expected start {expected_start}, got {stage.layers[0]}",
            )
            expected_start = stage.layers[1]
            _require(not stage.sp or self.seq_len % stage.tp == 0, f"{where}.sp",
                     f"sequence parallelism needs seq_len {self.seq_len} divisible by tp = {stage.tp}")
            samples = stage.micro_batch * stage.dp * self.grad_accum
            _require(
                samples == self.global_batch, f"{where}.micro_batch",
                f"micro_batch * dp * grad_accum = {stage.micro_batch} * {stage.dp} * {self.grad_accum} = {samples} "
                f"must equal global_batch = {self.global_batch}",
            )

    def _check_schedule(self) -> None:
        _require(self.schedule in SCHEDULES, "schedule", f"unknown schedule {self.schedule!r}; known: {sorted(SCHEDULES)}")
        v = self.virtual_stages
        _require(len(self.stages) % v == 0, "virtual_stages",
                 f"{len(self.stages)} stages cannot be {v} virtual stages per group of devices")
        problem = schedule_problem(self.schedule, self.pp, v, self.grad_accum)
        if problem is not None:
            _require(False, *problem)
        for index, where in enumerate(self.placement):
            group, stage = self.stages[where], self.stages[index]
            for key in ("nodes", "gpus_per_node", "dp", "tp", "micro_batch", "zero"):
                _require(getattr(stage, key) == getattr(group, key), f"stages[{index}].{key}",
                         f"virtual stage {index} runs on the devices of stage {where} ({self.schedule!r} with "
                         f"{v} virtual stages), so it needs its {key} {getattr(group, key)}, got {getattr(stage, key)}")

    def check_against_model(self, num_layers: int, max_seq: int | None = None) -> None:
        """Reject a plan whose layer ranges do not match the model's layer count."""
        _require(
            self.num_layers == num_layers, "stages",
            f"the plan covers {self.num_layers} layers but model {self.model!r} has {num_layers}",
        )
        if max_seq is not None:
            _require(self.seq_len <= max_seq, "seq_len", f"{self.seq_len} exceeds the model's maximum {max_seq}")

    def to_dict(self) -> dict:
        data = {
            "model": self.model, "seq_len": self.seq_len, "global_batch": self.global_batch,
            "dtype": self.dtype, "grad_accum": self.grad_accum,
            "stages": [stage.to_dict() for stage in self.stages],
        }
        if self.low_precision_grads:  # plans of the default keep their schema unchanged
            data["grad_dtype"] = self.grad_dtype
        if self.compiled != COMPILED_DEFAULT:
            data["compiled"] = self.compiled
        if not self.fused_loss:
            data["fused_loss"] = False
        if self.schedule != DEFAULT_SCHEDULE:
            data["schedule"] = self.schedule
        if self.virtual_stages != 1:
            data["virtual_stages"] = self.virtual_stages
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def load_plan(path: str) -> Plan:
    """Read a plan from a JSON or YAML file (by extension), validating it."""
    if not os.path.isfile(path):
        raise PlanError(f"plan file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except UnicodeDecodeError as error:
        raise PlanError(f"plan file {path!r} cannot be parsed: not UTF-8 text "
                        f"(byte {error.object[error.start]:#04x} at offset {error.start})") from None
    except Exception as error:  # both parsers raise their own error types
        raise PlanError(f"plan file {path!r} cannot be parsed: {_parse_problem(error)}") from None
    return Plan.from_dict(data)


def _parse_problem(error: Exception) -> str:
    """One line from a parser's error: YAML's problem and context with their positions, no marker lines."""
    problem = getattr(error, "problem", None)
    if problem:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        context = getattr(error, "context", None)
        return f"{context + ': ' if context else ''}{problem}{where}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def save_plan(plan: Plan, path: str) -> None:
    """Write the plan (YAML for ``.yaml``/``.yml``, else JSON) atomically."""
    if path.endswith((".yaml", ".yml")):
        import yaml

        text = yaml.safe_dump(plan.to_dict(), sort_keys=False)
    else:
        text = plan.to_json() + "\n"
    write_atomic(path, text)
