"""Prove a tensor-parallel split on the model at hand before anything trains.

The recogniser's rules (``passes/tp_recognition.py``) can be fooled by code they do not model (a
size computed from a split dimension and used in arithmetic, a layer-specific trick). So before a
plan with ``tp > 1`` runs, :func:`prove_tensor_parallel` runs the captured program itself, one
layer per group of identical layers plus the embedding and the head, at the model's real shapes
on a tiny batch: once whole, and once split over ``degree`` ranks played by threads of this
process (:class:`~mist_compiler.ops.groups.ThreadGroup`), through the very lowering
passes and modules the ranks will run, in float32 whatever the plan's dtype (:func:`in_float32`),
with dropout on (both runs draw the same masks, ``ops.dropout``) and a batch of 3 (not capture's
example batch of 2: a size baked from it would show). The loss and every gradient (each rank's slice of a
split tensor) must agree; otherwise the plan is refused, naming the tensor that differs. With
``sp`` the split run uses sequence parallelism too (the layers' norms and residuals on sequence
chunks), proving the sequence-parallel rewrite the same way.
"""
from __future__ import annotations

import threading
from dataclasses import replace

import torch

from ..ir.model_graph import BUFFER, DROPOUT_SEEDS, ModelGraph
from ..ir.plan import Plan
from ..ir.program import MistProgram
from ..ir.topology import RankCoord
from ..lowering.materialize import TensorSource, build_stage, shard
from ..ops.dropout import sample_seeds
from ..ops.groups import ThreadGroup
from ..passes.tp_model import derives_from
from ..passes.tp_sharding import TensorParallelError, check_degree

TOLERANCE = 1e-4  # relative (Frobenius) difference; fp32 summation-order noise on a tiny batch is ~1e-6
NEAR_ZERO = 1e-2  # a gradient below this fraction of the model's typical size is judged at that size
_proven: dict[tuple[int, int, bool], bool] = {}


def reduced_graph(model: ModelGraph) -> ModelGraph:
    """The captured graph as a model of one layer per group (layer ``i`` is traced layer ``i``)."""
    regions = [replace(r, layers=(r.traced,)) for r in model.regions]
    return replace(model, regions=regions, num_layers=len(regions))


class RandomTensors:
    """Seeded random parameters of the captured shapes; buffers from ``buffers`` (their real values)."""

    def __init__(self, model: ModelGraph, buffers: TensorSource | None, seed: int = 0) -> None:
        self.shapes: dict[str, tuple] = {}
        by_name = model._by_name()
        for placeholder, (kind, name) in model.tensors.items():
            self.shapes[name] = by_name[placeholder].meta["example_value"]
        for region in model.regions:
            for placeholder, attr in region.params.items():
                self.shapes[model.layer_fqn(region.traced, attr)] = by_name[placeholder].meta["example_value"]
        self.buffers, self.seed = buffers, seed

    def full(self, kind: str, name: str) -> torch.Tensor:
        example = self.shapes[name]
        if kind == BUFFER and self.buffers is not None:
            return self.buffers.full(kind, _real_name(name))
        generator = torch.Generator().manual_seed(hash((self.seed, name)) & (2**62))
        if not example.dtype.is_floating_point:
            return torch.zeros(tuple(int(d) for d in example.shape), dtype=example.dtype)
        return torch.randn(tuple(int(d) for d in example.shape), generator=generator) * 0.2


def _real_name(name: str) -> str:
    return name


def _plan(model: ModelGraph, degree: int, seq: int, batch: int, sp: bool = False) -> Plan:
    stage = {"layers": [0, model.num_layers], "nodes": 1, "gpus_per_node": degree, "micro_batch": batch,
             "dp": 1, "tp": degree, **({"sp": True} if sp else {})}
    return Plan.from_dict({"model": "tp-check", "seq_len": seq, "global_batch": batch, "dtype": "float32",
                           "grad_accum": 1, "stages": [stage]})


def _run(program: MistProgram, plan: Plan, source, rank: int, group, batch: dict) -> tuple[float, dict]:
    from ..lowering.lower import lower_stage

    stage = lower_stage(program, plan, RankCoord(0, 0, rank))
    built = build_stage(stage, program.model_graph, source, device=torch.device("cpu"), group=group)
    in_float32(built.module)
    loss = built.module(**{name: batch[name] for name in built.interface.batch_inputs})
    loss.backward()
    grads = {}
    for unit, module in built.units:
        for name, param in module.named_parameters():
            key = built.fqn.get(f"{unit}.{name}", f"{unit}.{name}")
            grads[key] = (param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param),
                          built.shards.get(f"{unit}.{name}"))
    return float(loss.detach()), grads


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def in_float32(module: torch.nn.Module) -> None:
    """Run a program captured in fp16/bf16 in float32: the casts its code wrote in (an RMSNorm's
    ``.to(input_dtype)``, a router's ``.to(hidden.dtype)``) are baked into the graph as constants.
    The split is a property of the program's structure, so it is proven where rounding is small."""
    for graph_module in [m for m in module.modules() if isinstance(m, torch.fx.GraphModule)]:
        changed = False
        for node in graph_module.graph.nodes:
            args = torch.fx.node.map_aggregate(node.args, _float32)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, _float32)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            graph_module.recompile()


def _float32(value):
    return torch.float32 if isinstance(value, torch.dtype) and value in _LOW_PRECISION else value


def _difference(got: torch.Tensor, expected: torch.Tensor, typical: float) -> float:
    """``||got - expected||`` relative to ``expected``'s norm, or, for a gradient far smaller than
    the model's typical one (``typical``: the whole gradient's RMS; OPT's key bias, whose gradient is
    zero up to rounding because softmax ignores a constant added to every key), relative to
    ``NEAR_ZERO`` times its share of the typical norm: rounding noise there says nothing about the split."""
    a64, b64 = got.double(), expected.double()
    share = NEAR_ZERO * typical * b64.numel() ** 0.5
    return float((a64 - b64).norm()) / max(float(b64.norm()), share, 1e-30)


def _typical(whole: dict) -> float:
    """The RMS of every gradient of the whole program taken together."""
    total = sum(float(g.double().pow(2).sum()) for g, _ in whole.values())
    count = sum(g.numel() for g, _ in whole.values())
    return (total / max(count, 1)) ** 0.5


def prove_tensor_parallel(program: MistProgram, degree: int, seq: int | None = None, batch: int = 3,
                          sp: bool = False) -> None:
    """Raise :class:`TensorParallelError` unless the split over ``degree`` ranks (sequence-parallel
    with ``sp``) computes what the whole program does (see the module docstring). Cached per
    program, degree and ``sp``."""
    key = (id(program), degree, sp)
    if degree == 1 or _proven.get(key):
        return
    check_degree(program.model_graph.tp, degree)
    model = reduced_graph(program.model_graph)
    reduced = replace(program, model_graph=model)
    seq = seq or max(4, min(8, program.seq_len or 8))
    if sp and seq % degree:
        seq = degree * max(1, -(-seq // degree))
    source = RandomTensors(model, None)
    vocab = _vocabulary(model)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    data = {"input_ids": ids, "labels": torch.randint(0, vocab, (batch, seq), generator=generator),
            DROPOUT_SEEDS: sample_seeds(0, 0, torch.arange(batch))}  # both runs draw the same dropout masks
    whole_loss, whole = _run(reduced, _plan(model, 1, seq, batch), source, 0, None, data)
    shared = ThreadGroup.Shared(degree)
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = _run(reduced, _plan(model, degree, seq, batch, sp), source, rank, ThreadGroup(shared, rank),
                                 data)
        except BaseException as error:  # reported below, in the calling thread
            errors.append(error)
            shared.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(degree)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        error = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        raise TensorParallelError(f"tp={degree}{' sp' if sp else ''}: the split program fails on the model: "
                                  f"{type(error).__name__}: {error}")
    _compare(whole_loss, whole, results, degree)
    _proven[key] = True


def _compare(whole_loss: float, whole: dict, results: dict, degree: int) -> None:
    typical = _typical(whole)
    for rank, (loss, grads) in sorted(results.items()):
        if abs(loss - whole_loss) > TOLERANCE * max(abs(whole_loss), 1e-6):
            raise TensorParallelError(f"tp={degree}: the split program's loss {loss:.6g} on rank {rank} differs from "
                                      f"the whole program's {whole_loss:.6g}; the model's code splits in a way the "
                                      "tensor-parallel rules do not capture")
        for name, (grad, spec) in grads.items():
            expected = shard(whole[name][0], spec, rank, degree)
            difference = _difference(grad, expected, typical)
            if difference > TOLERANCE:
                raise TensorParallelError(f"tp={degree}: the gradient of {name} on rank {rank} differs from the whole "
                                          f"program's by {difference:.2e} (relative); this model cannot be split "
                                          "that way safely")


def _vocabulary(model: ModelGraph) -> int:
    """The token vocabulary: the first dimension of the embedding the input ids index."""
    by_name = model._by_name()
    ids = {p for p, name in model.batch_inputs.items() if name == "input_ids"}
    for node in model.graph.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "embedding":
            weight = node.args[1]
            if derives_from(node.args[0], ids) and weight.name in model.tensors:
                return int(by_name[weight.name].meta["example_value"].shape[0])
    return 2
