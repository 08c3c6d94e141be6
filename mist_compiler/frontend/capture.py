"""``capture``: a model (module or name) -> MistProgram, as one list of passes.

No real weight is allocated: the model is built (or copied) with FakeTensor weights. Layers are
first grouped by the structure of their module tree (types, parameter and buffer shapes, forward
code); one layer per group is kept, so an 80-layer model is traced as a 1-layer one. The joint
forward+backward ATen graph of that model is traced with the micro-batch ``b`` and sequence
``s`` symbolic, then cut into pre / layer / post blocks, hashed (Weisfeiler-Lehman over each
layer's op graph) and lowered to the IR.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
from dataclasses import replace
from typing import Any, Callable, Sequence

import networkx as nx
import torch
from torch import nn
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

from ..ir.capture_state import CaptureState
from ..ir.program import ATTENTION_KERNELS, IRError, MistProgram
from ..ir.vocabulary import TORCH_DTYPES
from ..models import resolve_model
from ..passes.block_discovery import block_discovery, wl_hash
from ..passes.manager import PassManager, PassResult, transforms
from ..passes.shape_prop import shape_prop
from ..passes.sp_recognition import recognise_sequence_parallel as recognise_sequence
from ..passes.tp_model import recognise
from .boundaries import install_boundary_hooks
from .dropout_sites import seed_dropout
from .fake_kernels import eager_fake
from .joint import CaptureError, loss_of, model_call_kwargs, trace_joint
from .layer_chain import prove_layer_chain
from .layer_stack import LayerStackError, find_layer_stack
from .regions import find_regions, with_real_names
from .to_ir import lower_to_ir

# what a forward that depends on tensor *values* raises under FakeTensorMode
FAKE_TENSOR_LIMITS = (
    fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
    fake_tensor.UnsupportedOperatorException, GuardOnDataDependentSymNode,
)
EXAMPLE_BATCH = 2


def capture(
    model: nn.Module | str,
    example_inputs: Sequence[torch.Tensor] | None = None,
    *,
    seq_len: int | None = None,
    dtype: str | torch.dtype | None = None,
    attention: str = "flash",
    print_after: Sequence[str] = (),
    on_dump: Callable[[str, Any], None] | None = None,
    analyse: bool = True,
) -> MistProgram:
    """Capture ``model`` (an nn.Module, a zoo name, ``hf:config.json`` or ``module:function``).

    ``example_inputs`` (optional ``(input_ids,)`` or ``(input_ids, labels)``, 2-D integer
    tensors) fix the token dtypes; their sizes do not matter: shapes are always symbolic in ``b``
    and ``s``. ``seq_len`` is the default value of ``s`` (the model's maximum sequence length
    when omitted); ``dtype`` casts the floating-point weights (default: as built);
    ``attention`` is the target kernel (``flash`` or ``math``). ``print_after`` / ``on_dump``
    show the state after the named passes (``mistc ir --after``). ``analyse=False`` stops at the
    torch-level program (what a rank runs; nothing is priced), skipping the joint graph.
    """
    if attention not in ATTENTION_KERNELS:
        raise IRError(f"attention must be one of {list(ATTENTION_KERNELS)}, got {attention!r}")
    state = CaptureState(model, model if isinstance(model, str) else type(model).__name__, attention,
                         _dtype_name(dtype), seq_len, token_dtypes=_token_dtypes(example_inputs), analyse=analyse)
    passes = [
        build_fake_model,  # weights become FakeTensors (no memory)
        group_layers,  # layers with the same module structure form a group
        keep_one_layer_per_group,  # trace one representative per group
        cast_weights,  # the kept weights in the requested dtype
        check_model_output,  # forward returns a scalar loss or logits
        check_layer_chain,  # the layers run back to back (no code between them that one layer would hide)
        trace_joint_graph,  # dynamo + aot_autograd: joint forward+backward ATen graph, b and s symbolic
        *passes_after_trace(),
    ]
    return run_capture_passes(state, passes, print_after=print_after, on_dump=on_dump)


def passes_after_trace() -> list:
    """The passes that read the trace (``state.joint``), in order: what every capture shares, the
    one that traces a module here and the one cut from the graph dynamo hands the backend."""
    return [
        find_model_graph,  # the torch-level graph of the same trace, cut into pre / layers / post
        seed_dropout_sites,  # dropout masks a function of (sample, layer, site, position): every plan draws the same
        recognise_tensor_parallel,  # the one tensor-parallel recogniser: how each tensor splits, or why not
        recognise_sequence_parallel,  # which layer code runs on a chunk of the sequence, or why not
        shape_prop,  # every node's shape as sympy in b, s
        block_discovery,  # pre / layers / post, Weisfeiler-Lehman class hash per layer
        lower_to_ir,  # IR nodes, attention op, saved tensors per block class
    ]


def run_capture_passes(state: CaptureState, passes: list, print_after: Sequence[str] = (),
                       on_dump: Callable[[str, Any], None] | None = None) -> MistProgram:
    """Run capture ``passes`` on ``state`` and return the program (``state.analyse`` False: stop
    before the shapes, the torch-level program only)."""
    if not state.analyse:
        passes = passes[:passes.index(shape_prop)]
    manager = PassManager(passes, print_after=print_after, on_dump=on_dump)
    final = manager(state).program
    if not state.analyse:
        return MistProgram(final.model_name, [], {}, final.dtype, final.attention, final.seq_len, ("b", "s"),
                           dict(final.config or {}), (), final.max_positions, final.model_graph)
    return replace(final.program, model_graph=final.model_graph)


def _token_dtypes(example_inputs: Sequence[torch.Tensor] | None) -> tuple:
    if example_inputs is None:
        return (torch.long, torch.long)
    inputs = list(example_inputs)
    if not 1 <= len(inputs) <= 2:
        raise IRError(f"example_inputs: expected (input_ids,) or (input_ids, labels), got {len(inputs)} values")
    for name, tensor in zip(("input_ids", "labels"), inputs):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.is_floating_point():
            described = f"shape {tuple(tensor.shape)}, {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise IRError(f"example_inputs: {name} must be a 2-D integer tensor [batch, seq], got {described}")
    return (inputs[0].dtype, inputs[-1].dtype)


def _dtype_name(dtype: str | torch.dtype | None) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    if name not in TORCH_DTYPES:
        raise IRError(f"dtype must be one of {list(TORCH_DTYPES)}, got {dtype!r}")
    return name


def fake_copy(model: nn.Module, fake_mode: FakeTensorMode) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are FakeTensors (ties and shared modules kept).

    Module objects are shallow-copied (their code and plain attributes are shared); ``model``
    itself is not modified.
    """
    tensors: dict[int, torch.Tensor] = {}
    modules: dict[int, nn.Module] = {}

    def fake(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        if id(tensor) not in tensors:
            value = fake_mode.from_tensor(tensor.detach(), static_shapes=True)
            tensors[id(tensor)] = nn.Parameter(value, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else value
        return tensors[id(tensor)]

    def copy_module(module: nn.Module | None) -> nn.Module | None:
        if module is None:
            return None
        if id(module) not in modules:
            copied = modules[id(module)] = copy.copy(module)
            copied._parameters = {k: fake(v) for k, v in module._parameters.items()}
            copied._buffers = {k: fake(v) for k, v in module._buffers.items()}
            copied._modules = {k: copy_module(v) for k, v in module._modules.items()}
        return modules[id(module)]

    return copy_module(model)


@transforms(CaptureState)
def build_fake_model(state: CaptureState) -> CaptureState:
    """Pass: the model with FakeTensor weights, in the requested dtype."""
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    config = native = None
    if isinstance(state.source, str):
        spec = resolve_model(state.source, state.seq_len)
        with fake_mode:
            model = spec.build()
        config = spec.config.to_dict() if spec.config is not None else None
        if spec.config is not None:  # a zoo model built for a longer seq_len still has only its own positions
            native = resolve_model(state.source).config.max_seq
    elif isinstance(state.source, nn.Module):
        model = fake_copy(state.source, fake_mode)
        cfg = getattr(state.source, "config", None)
        config = cfg.to_dict() if hasattr(cfg, "to_dict") else None
    else:
        raise IRError(f"capture: model must be an nn.Module or a model name, got {type(state.source).__name__}")
    if config is None and hasattr(getattr(model, "config", None), "to_dict"):
        config = model.config.to_dict()  # Hugging Face models
    dtype = state.dtype or _param_dtype(model)
    max_positions = native if native is not None else _max_seq(config)  # callers refuse longer sequences (plans, --seq), naming their field
    seq_len = state.seq_len or max_positions or 2048
    return replace(state, model=model, fake_mode=fake_mode, config=config, dtype=dtype, seq_len=seq_len,
                   max_positions=max_positions)


@transforms(CaptureState)
def cast_weights(state: CaptureState) -> CaptureState:
    """Pass: cast the reduced model's floating-point weights to the requested dtype (after the
    reduction: the layers that are not traced are never cast, which costs 0.4 s on a 48-layer model)."""
    if state.dtype is not None:
        with state.fake_mode:
            cast_floating(state.model, TORCH_DTYPES[state.dtype])
    return state


def cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters and buffers of our own fake copy, ties preserved."""
    memo: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, value in table.items():
                if value is None or not value.is_floating_point() or value.dtype == dtype:
                    continue
                if id(value) not in memo:
                    cast = value.detach().to(dtype)
                    memo[id(value)] = nn.Parameter(cast, value.requires_grad) if isinstance(value, nn.Parameter) else cast
                table[key] = memo[id(value)]


def _param_dtype(model: nn.Module) -> str:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return str(parameter.dtype).replace("torch.", "")
    return "float32"


def _max_seq(config: dict | None) -> int | None:
    for key in ("max_seq", "n_positions", "max_position_embeddings"):
        if config and isinstance(config.get(key), int):
            return config[key]
    return None


def find_layer_list(model: nn.Module) -> str | None:
    """Module path of the longest nn.ModuleList (the repeated layers, of any classes), or None."""
    try:
        return find_layer_stack(model, one_class=False).path
    except LayerStackError:
        return None


# per-layer counters every layer differs in without running different code
_INDEX_ATTRIBUTES = {"layer_idx", "layer_id", "layer_index", "layer_number", "idx", "index", "block_idx"}


def _plain_attributes(module: nn.Module) -> list[tuple[str, str]]:
    """The module's own settings of plain types (a sliding window, an attention type ...): layers
    of one class that differ in them may run different code, so they are not grouped together."""
    found = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or key in _INDEX_ATTRIBUTES or key == "training":
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            found.append((key, repr(value)))
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            found.append((key, repr(tuple(value))))
    return found


def module_signature(module: nn.Module) -> str:
    """WL hash of a module tree: types, forward code, plain settings, parameter/buffer shapes and dtypes."""
    tree = nx.DiGraph()
    for name, sub in module.named_modules():
        tensors = [(k, tuple(v.shape), str(v.dtype)) for k, v in list(sub._parameters.items()) + list(sub._buffers.items())
                   if v is not None]
        forward = getattr(type(sub).forward, "__qualname__", "")
        tree.add_node(name, label=f"{type(sub).__qualname__}|{forward}|{tensors}|{_plain_attributes(sub)}")
        if name:
            tree.add_edge(name.rpartition(".")[0], name)
    return hashlib.sha1(wl_hash(tree).encode()).hexdigest()[:16]


@transforms(CaptureState)
def group_layers(state: CaptureState) -> CaptureState:
    """Pass: find the layer list and group its layers by module signature."""
    path = find_layer_list(state.model)
    if path is None:
        return replace(state, layer_list=None, layer_groups=())
    layers = state.model.get_submodule(path)
    groups: dict[str, list[int]] = {}
    for index, layer in enumerate(layers):
        groups.setdefault(module_signature(layer), []).append(index)
    return replace(state, layer_list=path, layer_groups=tuple(tuple(g) for g in groups.values()))


def replace_submodule(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """A shallow copy of ``root`` with the module at ``path`` replaced (``root`` is untouched)."""
    head, _, rest = path.partition(".")
    copied = copy.copy(root)
    copied._modules = dict(root._modules)
    copied._modules[head] = new if not rest else replace_submodule(root._modules[head], rest, new)
    return copied


@transforms(CaptureState)
def keep_one_layer_per_group(state: CaptureState) -> CaptureState:
    """Pass: a model whose layer list holds one representative per group (traced in that order)."""
    if state.layer_list is None:
        return state
    layers = state.model.get_submodule(state.layer_list)
    kept = nn.ModuleList(copy.copy(layers[group[0]]) for group in state.layer_groups)
    install_boundary_hooks(kept, state.layer_list)  # on capture's own copies (hook tables made private)
    return replace(state, model=replace_submodule(state.model, state.layer_list, kept))


@transforms(CaptureState)
def check_layer_chain(state: CaptureState) -> PassResult:
    """Pass (check): the traced program stands for the whole model only if the layers are called
    back to back, each on the previous one's output; one eager fake forward with the kept layers
    run twice over proves it (:mod:`.layer_chain`)."""
    if state.layer_list is None or sum(len(group) for group in state.layer_groups) < 2:
        return PassResult(state, modified=False)
    input_ids, labels = _example_tokens(state)
    extra = model_call_kwargs(state.model)

    def run_forward(repeated: nn.ModuleList) -> None:
        with eager_fake(state.fake_mode):
            replace_submodule(state.model, state.layer_list, repeated)(input_ids=input_ids, labels=labels, **extra)

    names = [f"{state.layer_list}.{group[0]}" for group in state.layer_groups]
    prove_layer_chain(run_forward, state.model.get_submodule(state.layer_list), state.layer_list, names,
                      list(state.layer_groups))
    return PassResult(state, modified=False)


def _example_tokens(state: CaptureState) -> tuple[torch.Tensor, torch.Tensor]:
    seq = max(3, min(16, state.seq_len or 16))
    with state.fake_mode:
        input_ids = torch.zeros(EXAMPLE_BATCH, seq, dtype=state.token_dtypes[0])
        labels = torch.zeros(EXAMPLE_BATCH, seq, dtype=state.token_dtypes[1])
    return input_ids, labels


@transforms(CaptureState)
def check_model_output(state: CaptureState) -> PassResult:
    """Pass (check): one eager fake forward; the output must be a scalar loss or logits."""
    input_ids, labels = _example_tokens(state)
    extra = model_call_kwargs(state.model)
    try:
        signature = inspect.signature(state.model.forward)
        signature.bind(input_ids=input_ids, labels=labels, **extra)
    except TypeError:
        raise CaptureError(f"capture: {state.model_name} is not a language model Mist can train: its forward must "
                           f"accept input_ids and labels and return the loss, not "
                           f"{type(state.model).__name__}.forward{signature}") from None
    except ValueError:  # no signature to inspect: call it
        pass
    try:
        with eager_fake(state.fake_mode), torch.no_grad():
            output = state.model(input_ids=input_ids, labels=labels, **extra)
    except FAKE_TENSOR_LIMITS as error:
        caused = [line.strip() for line in str(error).splitlines() if "Caused by" in line]
        raise CaptureError(
            f"capture: {state.model_name}'s forward cannot run without real data (it depends on tensor values): "
            f"{str(error).splitlines()[0]} {' '.join(caused)}".rstrip()
        ) from None
    except TypeError as error:  # e.g. a keyword the forward passes on to a module that does not take it
        raise CaptureError(f"capture: {state.model_name}'s forward(input_ids=..., labels=...) raised TypeError: "
                           f"{(str(error).splitlines() or [''])[0]}") from None
    loss_of(output, state.model_name)
    return PassResult(state, modified=False)


@transforms(CaptureState)
def find_model_graph(state: CaptureState) -> CaptureState:
    """Pass: the torch-level graph of the trace, cut into regions (what the lowering runs)."""
    if state.layer_list is None or not state.joint.boundaries:
        return state  # no layer list: analysable, but only as a whole (no pipeline)
    graph = find_regions(state.joint.torch_graph, state.joint.boundaries, state.layer_list, state.layer_groups,
                         inputs=state.joint.input_kinds)
    graph = replace(with_real_names(graph, state.layer_groups), primals=dict(state.joint.primal_sources))
    return replace(state, model_graph=graph)


@transforms(CaptureState)
def seed_dropout_sites(state: CaptureState) -> CaptureState:
    """Pass: dropout and attention dropout drawn from per-sample seeds (:mod:`.dropout_sites`)."""
    if state.model_graph is None:
        return state
    return replace(state, model_graph=seed_dropout(state.model_graph))


@transforms(CaptureState)
def recognise_tensor_parallel(state: CaptureState) -> CaptureState:
    """Pass: decide how the model splits over tensor-parallel ranks (priced and run alike)."""
    if state.model_graph is None:
        return state
    return replace(state, model_graph=replace(state.model_graph, tp=recognise(state.model_graph)))


@transforms(CaptureState)
def recognise_sequence_parallel(state: CaptureState) -> CaptureState:
    """Pass: decide whether the layers' code between their tensor-parallel regions can run on a chunk
    of the sequence (sequence parallelism), and where its edges are."""
    if state.model_graph is None:
        return state
    return replace(state, model_graph=replace(state.model_graph, sp=recognise_sequence(state.model_graph)))


@transforms(CaptureState)
def trace_joint_graph(state: CaptureState) -> CaptureState:
    """Pass: joint forward+backward ATen graph of the (reduced) model, b and s symbolic."""
    input_ids, labels = _example_tokens(state)
    with state.fake_mode:
        joint = trace_joint(state.model, input_ids, labels, analyse=state.analyse)
    return replace(state, joint=joint)
