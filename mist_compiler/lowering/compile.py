"""Compilation of a lowered stage program: every unit through inductor.

:func:`compile_stage` is the last step of the lowering (DESIGN.md 2.4). Each unit module of a
:class:`~.materialize.StageProgram` (the pre unit, every layer, each post unit) keeps its identity,
so the runtime's module hooks still fire around it, but its ``forward`` becomes a
:class:`CompiledUnit`:

- **One artefact per distinct program.** The unit's graph is turned into a function of its
  tensors (weights, buffers, constants become inputs) and of its arguments; layers of one class
  run one graph (the same code with other weights), so they share one compiled artefact. It is
  compiled at the unit's first call, from the real inputs' metadata (shapes, strides, dtypes,
  ``requires_grad``; integer arguments are baked in, as dynamo's static mode does), by inductor's
  ``compile_fx``: AOTAutograd (joint graph, min-cut partition) then inductor kernels (C++/OpenMP
  on a CPU, Triton on a GPU). Another set of input metadata compiles another artefact.
- **The runtime's own work stays between compiled regions.** A unit's graph is cut at its calls of
  the tensor-parallel collectives (``tp.*`` children, ``mist_compiler.ops.tensor_parallel``), which
  run eagerly between compiled segments; ZeRO gathers and reductions, offload copies and their
  prefetches run in the runtime's hooks around the unit; P2P and loss scaling in the engine.
- **Memory mechanisms see what the compiled code saves.** A compiled segment is one autograd node
  whose saved tensors its partitioner chose; they pass through ``saved_tensors_hooks`` like eager
  ones, so activation offload (hooks around the unit's forward) and non-reentrant checkpointing
  (around the unit call: the compiled forward runs again in the backward) hold for it. A per-tensor
  policy does not: it decides per node of the eager program, and a compiled region's saved tensors
  name no node, so a unit with a plan's policy keeps its eager program (priced so by the cost model).
  A dropout's mask is not saved: the compiled backward draws it again from the seeds (a hash: cheaper
  on a CPU than storing and reading the boolean mask, and a byte an element less memory).
- **Caches on disk.** inductor's FX graph cache (``TORCHINDUCTOR_CACHE_DIR``) lets a second run of the
  same plan load its kernels instead of compiling them; :class:`CompileStats` says how long
  compilation took and how much came from the cache. AOTAutograd's own cache is off for units: it keys
  the unit's graph, not the code of the custom ops traced into it (``mist::linear_cross_entropy``), and
  served a stale loss after the op changed; each start traces the units again (about a second each).

``compile_stage(..., enabled=False)`` (``--no-compile``) keeps the eager program, for debugging.
"""
from __future__ import annotations

import contextlib
import operator
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch
import torch.fx as fx
from torch import nn

from ..ops.dropout import apply_keep, attention_probabilities, counter_attention, counter_dropout, dropout_keep
from .materialize import StageProgram
from .split_backward import SplitBackward

PARTITIONER_TAGS = ("recompute", "ac_graph_id")  # node metadata that says what the min-cut partition must recompute
EAGER_MODULE_PREFIX = "tp."  # call_module targets that run eagerly between compiled segments, but for:
TRACED_TP_CHILDREN = ("tp.dropout", "tp.attention")  # a split value's dropout: no collective, compiled in
ATTENTION_DROPOUT_KWARGS = ("dropout_p", "seeds", "layer", "site")  # counter_attention's dropout arguments


ENVIRONMENT_SWITCH = "MIST_COMPILE"  # "0": eager units unless a caller asks otherwise (the test suite's default)


def default_enabled() -> bool:
    """Whether units are compiled when the caller does not say: yes, unless ``MIST_COMPILE=0``."""
    return os.environ.get(ENVIRONMENT_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class CompileStats:
    """What compiling a stage's units cost so far (each is compiled at its first call)."""

    enabled: bool = True
    units: int = 0  # unit modules given a compiled forward
    eager_units: int = 0  # unit modules kept eager (compilation off, split backward halves, per-tensor policies)
    programs: int = 0  # distinct unit programs (identical layers share one)
    graphs: int = 0  # compiled regions (a forward and its backward), one per program segment and input metadata
    compiled: int = 0  # of those, compiled from scratch (the others came from inductor's on-disk caches or
    # from another engine of this process)
    seconds: float = 0.0  # wall time spent compiling or loading them
    failed: int = 0  # regions inductor could not compile: they run eagerly
    seen: set = field(default_factory=set, repr=False)

    @property
    def cached(self) -> int:
        return self.graphs - self.compiled

    @property
    def from_cache(self) -> bool:
        return self.graphs > 0 and self.compiled == 0

    def describe(self) -> str:
        """One line for logs: how long compilation took and whether it came from the cache."""
        if not self.enabled:
            return f"{self.eager_units} units run eagerly (compilation off)"
        if not self.graphs:
            return f"{self.units} units ({self.programs} programs) not compiled yet"
        source = "all from the cache" if self.from_cache else \
            ("compiled, none cached" if not self.cached else f"{self.cached} of them from the cache")
        eager = f"; {self.eager_units} units eager (split backward or per-tensor policy)" if self.eager_units else ""
        eager += f"; {self.failed} graphs failed to compile, run eagerly" if self.failed else ""
        return (f"compiled {self.units} units ({self.programs} programs, {self.graphs} graphs) in "
                f"{self.seconds:.1f} s ({source}{eager})")


@dataclass
class _Segment:
    """Consecutive nodes of a unit graph: compiled together, or one eager module call."""

    nodes: list[fx.Node]
    inputs: list[str]  # names of the values it reads from outside (graph inputs or earlier nodes)
    outputs: list[str]  # names of its values read later (or returned)
    eager: bool = False


@dataclass
class UnitProgram:
    """A unit graph cut into segments, shared by every unit module that runs the same code."""

    graph: fx.Graph
    placeholders: list[str]
    attrs: dict[str, str]  # get_attr node name -> attribute path
    segments: list[_Segment]
    output: Any  # the output node's argument (names to read from the environment)
    key: str = ""  # the graph's code: units (and engines of this process) with the same code share artefacts


# compiled artefacts of this process: (program key, segment, input metadata, grad mode) -> callable; pure
# functions of their inputs, so every engine of the process shares them (a second engine loads nothing)
_ARTEFACTS: dict[Hashable, Callable] = {}


def _is_eager(node: fx.Node, eager: set[str]) -> bool:
    """A collective module call, or an item taken from its result (tuples do not cross into compiled code)."""
    if node.op == "call_module" and str(node.target).startswith(EAGER_MODULE_PREFIX):
        return not (node.target in TRACED_TP_CHILDREN and isinstance(node.kwargs.get("block"), int)
                    and node.kwargs["block"] > 0)
    return node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
        and node.args[0].name in eager


def split_segments(graph: fx.Graph) -> UnitProgram:
    """Cut ``graph`` at its eager module calls (:data:`EAGER_MODULE_PREFIX`)."""
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    attrs = {n.name: str(n.target) for n in graph.nodes if n.op == "get_attr"}
    output = next(n for n in graph.nodes if n.op == "output")
    groups: list[tuple[list[fx.Node], bool]] = []
    eager_nodes: set[str] = set()
    for node in nodes:
        eager = _is_eager(node, eager_nodes)
        if eager:
            eager_nodes.add(node.name)
        if not groups or groups[-1][1] != eager:
            groups.append(([node], eager))
        else:
            groups[-1][0].append(node)
    position = {node.name: index for index, (group, _) in enumerate(groups) for node in group}
    segments = []
    for index, (group, eager) in enumerate(groups):
        inside = {n.name for n in group}
        inputs: list[str] = []
        for node in group:
            for arg in node.all_input_nodes:
                if arg.name not in inside and arg.name not in inputs:
                    inputs.append(arg.name)
        outputs = [n.name for n in group
                   if any(user.op == "output" or position.get(user.name, index) > index for user in n.users)]
        segments.append(_Segment(group, inputs, outputs, eager))
    return UnitProgram(graph, placeholders, attrs, segments, output.args[0], program_key(graph))


def _metadata(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, str(value.device),
                value.requires_grad)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return ("value", type(value).__name__, value)
    raise TypeError(f"compiled unit: cannot compile an argument of type {type(value).__name__}")


def _segment_module(segment: _Segment, values: list[Any], unit: nn.Module) -> fx.GraphModule:
    """A function of the segment's tensor inputs returning its outputs (a tuple); non-tensor inputs
    are baked in as constants."""
    graph = fx.Graph()
    env: dict[str, Any] = {}
    for name, value in zip(segment.inputs, values):
        env[name] = graph.placeholder(name) if isinstance(value, torch.Tensor) else value
    for node in segment.nodes:
        env[node.name] = _redrawn_dropout(graph, node, env, unit) or graph.node_copy(node, lambda arg: env[arg.name])
    graph.output(tuple(env[name] for name in segment.outputs))
    graph.eliminate_dead_code()
    return fx.GraphModule(nn.Module(), graph)


def _redrawn_dropout(graph: fx.Graph, node: fx.Node, env: dict[str, Any], unit: nn.Module) -> fx.Node | None:
    """A dropout node (``counter_dropout``, ``counter_attention``, or this rank's part of a split one,
    ``tp.dropout`` / ``tp.attention``) written out with its mask tagged for the partitioner to draw again
    in the backward (``MUST_RECOMPUTE``, as selective checkpointing tags a node); None for any other node.
    The hash costs about 1 ns an element each time on a CPU; saving the boolean mask cost 7 (inductor's
    C++ stores a 64-bit lane mask to bool element by element), and a byte an element of memory."""
    from torch.utils.checkpoint import CheckpointPolicy

    args = fx.node.map_arg(node.args, lambda arg: env[arg.name])
    kwargs = dict(fx.node.map_arg(node.kwargs, lambda arg: env[arg.name]))
    if node.op == "call_module" and node.target in TRACED_TP_CHILDREN:
        group = unit.get_submodule(str(node.target)).group
        function = counter_dropout if node.target == "tp.dropout" else counter_attention
        dim = kwargs.pop("dim", 0 if function is counter_dropout else 1)  # SplitDropout's, SplitAttention's default
        split = (dim, kwargs.pop("block"), tuple(kwargs.pop("parts", ())), group.rank, group.world)
    elif node.op == "call_function" and node.target in (counter_dropout, counter_attention):
        function, split = node.target, kwargs.pop("split", None)
    else:
        return None
    if function is counter_attention:
        p, drawn = kwargs.get("dropout_p", 0.0), [kwargs.get(name) for name in ATTENTION_DROPOUT_KWARGS[1:]]
    else:
        p, drawn = (args[1], list(args[2:5])) if len(args) == 5 else (None, [])
    drawable = isinstance(p, float) and 0.0 < p < 1.0 and len(args) == (3 if function is counter_attention else 5)
    if not drawable:  # nothing drawn, or not as the capture writes it: the call as it is (with its split)
        return None if node.op == "call_function" else graph.call_function(function, args, {**kwargs, "split": split})
    if function is counter_attention:  # probabilities, their dropout, then @ values
        probabilities = {name: value for name, value in kwargs.items() if name not in ATTENTION_DROPOUT_KWARGS}
        both = graph.call_function(attention_probabilities, args, probabilities)
        x, values = (graph.call_function(operator.getitem, (both, index)) for index in (0, 1))
    else:
        x, values = args[0], None
    keep = graph.call_function(dropout_keep, (x, p, *drawn, split))
    keep.meta.update({"recompute": CheckpointPolicy.MUST_RECOMPUTE, "ac_graph_id": 0})
    dropped = graph.call_function(apply_keep, (x, keep, p))
    return dropped if values is None else graph.call_function(torch.matmul, (dropped, values))


def _kernels_compiled() -> int:
    """inductor's count of graphs compiled from scratch (not found in its FX graph cache)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"]


def compile_segment(module: fx.GraphModule, inputs: list[torch.Tensor]) -> Callable:
    """inductor (through AOTAutograd) for one segment, specialised to ``inputs``' metadata.

    The inputs are turned into fake tensors of a mode with a shape environment (static shapes) and
    every node gets its fake value, as dynamo hands graphs over: what inductor's and AOTAutograd's
    on-disk caches need to key and accept the graph."""
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from torch.utils._python_dispatch import _disable_current_modes

    # the caller's dispatch modes (a memory tracker, a FLOP counter) must not shape the program: one
    # that runs a custom op's body while AOTAutograd traces would inline it (the fused loss, whose
    # backward the partitioner then half-moves into the forward, saving every vocabulary slice)
    with _saved_tensor_hooks_off(), _disable_current_modes():
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in inputs]
        for node in module.graph.nodes:  # all but the partitioner's tags (AOTAutograd copies them to the aten nodes)
            tags = {key: node.meta[key] for key in PARTITIONER_TAGS if key in node.meta}
            node.meta.clear()
            node.meta.update(tags)
        FakeTensorProp(module, fake_mode).propagate_dont_convert_inputs(*fakes)
        for node in module.graph.nodes:
            if "val" in node.meta:
                node.meta["example_value"] = node.meta["val"]
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(module, fakes)


@contextlib.contextmanager
def _saved_tensor_hooks_off():
    """Compile outside the saved-tensor hooks of the caller: a unit compiles at its first call, which
    may be inside a checkpointed region or under activation offload, whose hooks must not see the
    tracer's fake tensors (a checkpoint would count them as saved by the forward)."""
    previous = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
    torch._C._autograd._saved_tensors_hooks_disable("mist: no saved-tensor hooks while compiling a unit", False)
    try:
        yield
    finally:
        if previous is None:
            torch._C._autograd._saved_tensors_hooks_enable()
        else:
            torch._C._autograd._saved_tensors_hooks_disable(previous, False)


class CompiledUnit:
    """The forward of one unit module: its program's segments, compiled ones called with this
    module's tensors (see the module docstring)."""

    def __init__(self, module: nn.Module, program: UnitProgram, stats: CompileStats) -> None:
        self.module = module
        self.program = program
        self.stats = stats

    def _attr(self, path: str) -> Any:
        value: Any = self.module
        for part in path.split("."):
            value = getattr(value, part)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        program = self.program
        if len(args) > len(program.placeholders) or set(kwargs) - set(program.placeholders):
            raise TypeError(f"compiled unit takes {program.placeholders}, got {len(args)} positional and "
                            f"{sorted(kwargs)}")
        env: dict[str, Any] = dict(zip(program.placeholders, args))
        env.update(kwargs)
        for name, path in program.attrs.items():
            env[name] = self._attr(path)
        for index, segment in enumerate(program.segments):
            values = [env[name] for name in segment.inputs]
            if segment.eager:
                for node in segment.nodes:
                    self._run_eager(node, env)
                continue
            key = (program.key, index, tuple(_metadata(v) for v in values), torch.is_grad_enabled())
            artefact = _ARTEFACTS.get(key)
            if artefact is None:
                artefact = _ARTEFACTS[key] = self._compile(segment, values)
            if key not in self.stats.seen:  # the first use of an artefact in this stage
                self.stats.seen.add(key)
                self.stats.graphs += 1
            outputs = artefact([v for v in values if isinstance(v, torch.Tensor)])
            env.update(zip(segment.outputs, outputs))
        return fx.node.map_arg(program.output, lambda node: env[node.name])

    def _run_eager(self, node: fx.Node, env: dict[str, Any]) -> None:
        args = fx.node.map_arg(node.args, lambda arg: env[arg.name])
        kwargs = fx.node.map_arg(node.kwargs, lambda arg: env[arg.name])
        function = self.module.get_submodule(str(node.target)) if node.op == "call_module" else node.target
        env[node.name] = function(*args, **kwargs)

    def _compile(self, segment: _Segment, values: list[Any]) -> Callable:
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        module = _segment_module(segment, values, self.module)
        before = _kernels_compiled()
        start = time.perf_counter()
        try:
            compiled = compile_segment(module, tensors)
        except Exception as error:  # noqa: BLE001 (no C++ compiler, no Triton, an op inductor cannot lower)
            compiled = module  # the same segment, run op by op: training goes on, one line says why
            self.stats.failed += 1
            if self.stats.failed == 1:
                line = next((text.strip() for text in str(error).splitlines() if text.strip()), type(error).__name__)
                print(f"mist: inductor could not compile a unit ({type(error).__name__}: {line[:300]}); it runs "
                      "eagerly (slower than the plan was priced; --no-compile skips compiling)", file=sys.stderr,
                      flush=True)
        self.stats.seconds += time.perf_counter() - start
        self.stats.compiled += _kernels_compiled() != before

        def run(inputs: list[torch.Tensor]) -> Any:
            return compiled(*inputs)

        return run


class GlueDropout(nn.Module):
    """A dropout the stage runs between its units (the embedding's, after the token and position
    embeddings are added), compiled like a unit's: eagerly its hash is some thirty int64 passes over
    the value (20-40 ns an element on a CPU, against about 1 compiled) and its mask is saved."""

    def __init__(self, node: fx.Node, programs: dict[str, UnitProgram], stats: CompileStats) -> None:
        super().__init__()
        graph = fx.Graph()
        inputs = {arg.name: graph.placeholder(arg.name) for arg in node.all_input_nodes}
        graph.output(graph.call_function(counter_dropout, fx.node.map_arg(node.args, lambda arg: inputs[arg.name])))
        key = program_key(graph)
        self.inputs = list(inputs)
        self.run = CompiledUnit(self, programs.setdefault(key, split_segments(graph)), stats)

    def forward(self, *args: Any) -> Any:
        return self.run(*args)


def _compile_glue_dropouts(module: fx.GraphModule, programs: dict[str, UnitProgram], stats: CompileStats) -> None:
    """Each ``counter_dropout`` of ``module``'s own graph (between its units) becomes a call of a
    :class:`GlueDropout` child (``mist_dropout_<node>``)."""
    changed = False
    for node in list(module.graph.nodes):
        if node.op != "call_function" or node.target is not counter_dropout or node.kwargs:
            continue
        name = f"mist_dropout_{node.name}"
        glue = GlueDropout(node, programs, stats)
        module.add_module(name, glue)
        by_name = {arg.name: arg for arg in node.all_input_nodes}
        node.op, node.target = "call_module", name
        node.args = tuple(by_name[input_name] for input_name in glue.inputs)
        changed = True
    if changed:
        module.recompile()


def program_key(graph: fx.Graph) -> str:
    """Units whose graphs print the same code run the same program."""
    return graph.python_code("self").src


def compile_stage(program: StageProgram, *, enabled: bool | None = None) -> CompileStats:
    """Give every unit of ``program`` a compiled forward (module docstring); nothing changes when
    not ``enabled`` (None: :func:`default_enabled`). Returns the statistics the compiled forwards
    fill in as they compile."""
    enabled = default_enabled() if enabled is None else bool(enabled)
    # a unit whose backward is split (zero-bubble schedules) runs its halves as fx graphs: its custom
    # autograd function queues the weight half, which a compiled region cannot hold; a unit with a plan's
    # per-tensor policy runs eagerly: its markers attribute each saved tensor to the node that made it,
    # where a compiled region saves what its partitioner chose (the cost model prices it eager)
    policy_units = {name for name, (policy, _) in program.saved.items() if not policy.plain_offload}
    units = [(name, module) for name, module in program.units
             if not any(isinstance(child, SplitBackward) for child in module.children()) and name not in policy_units]
    stats = CompileStats(enabled=enabled, units=len(units), eager_units=len(program.units) - len(units))
    if not enabled:
        stats.units, stats.eager_units = 0, len(program.units)
        return stats
    programs: dict[str, UnitProgram] = {}
    for chunk in program.chunk_programs:
        _compile_glue_dropouts(chunk.module, programs, stats)
    for _name, module in units:
        graph = module.graph
        key = program_key(graph)
        if key not in programs:
            programs[key] = split_segments(graph)
        module.forward = CompiledUnit(module, programs[key], stats)
    stats.programs = len(programs)
    return stats


__all__ = ["CompileStats", "CompiledUnit", "UnitProgram", "compile_stage", "default_enabled", "split_segments"]
