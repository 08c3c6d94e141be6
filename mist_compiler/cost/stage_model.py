"""Stage cost model: time and memory of pipeline-stage candidates, vectorised (the tuner's oracle).

``build_stage_cost_model(program, hardware, seq_len=..., attention=...)`` takes a captured
``MistProgram`` (the driver's ``capture``: the cost model never captures), runs the cost-annotation and memory-analysis
passes on each block class (pre, layer, post), lambdifies their sympy expressions in
``(b, s, t)`` and returns a :class:`StageCostModel` whose ``evaluate`` prices any number of
:class:`~mist_compiler.cost.stage_api.StageCandidates` with numpy.

Per candidate (one pipeline stage, one device's view):
- compute: per op class roofline (``op_time``) of the stage's blocks, forward and backward (GEMMs
  one by one at their shape's rate when the profile has a ``matmul_shape_model``), plus the
  profile's fixed ``op_overhead`` per executed op (dispatch / kernel launch), plus the forward of
  the checkpointed layers again (recompute) during the backward;
- tensor-parallel all-reduces (from the annotation pass) on the critical path, exposed;
- ZeRO traffic over the ``dp`` group: levels 2-3 reduce-scatter gradients every micro-batch and
  level 3 all-gathers weights in forward and backward, overlapped with compute but for what no
  compute hides as the runtime orders it (``_unhidden_zero_traffic``: the gathers and reductions of
  the first and last units and of the units behind light ones), priced alone every micro-batch;
  levels 0-1 synchronise gradients once per iteration (``delta``), levels 1-2 all-gather updated
  weights after the step;
- offload copies: offloaded weights come in (h2d) for the forward and the backward of every
  micro-batch, offloaded gradients go out (d2h) every backward, offloaded activations go out in
  the forward and come back in the backward; offloaded optimizer states are stepped on the host
  (the profile's host AdamW rate) with their gradients out and weights back in (``delta``);
- pipeline point-to-point: a stage that is not the last sends its output forward and receives
  its gradient; a stage that is not the first does the opposite;
- channels of one phase are combined by the overlap model (``overlap.overlap``);
- ``stable_s`` = forward + backward phases of one micro-batch; ``delta_s`` = gradient
  synchronisation + optimizer step (device and host parts at the profile's AdamW rates) + adding
  the other micro-batches' gradients into the accumulator (low-precision gradients: the buffer's
  zeroing and fp32 casts, once) + offload traffic of the step (the host AdamW overlapping the device
  part's update and pipelining with its copies, ``optimizer_phase_s``) + (fp16) the loss scaler's
  inf/NaN pass over the reduced gradients;
- the math attention kernel adds its ``b*h*s*s`` score/probability traffic (``block_functions.MATH_ATTENTION_PASSES``);
- memory: ``cost.memory`` closed forms over the per-block liveness results.
Evaluation groups candidates by their distinct ``(micro_batch, tp, nodes, gpus_per_node)`` so
the symbolic parts run once per distinct value, then everything is array arithmetic.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..ir.program import MistProgram
from ..ir.vocabulary import COMPILED_DEFAULT, DEFAULT_DTYPE
from ..passes.memory_analysis import ATTENTION_KERNELS
from .analysis import analyse_program
from .block_functions import SEQUENCE_LAYER, BlockFunctions, block_functions, costliest_layer
from .blocks import BLOCK_KINDS, BlockAnalysis, StageModelError
from .comm import collective_seconds, collective_time, copy_time, group_links, group_shapes, p2p_time
from .hardware import HardwareProfile, load_profile
from .loss_kernel import plain_loss_deltas
from .memory import (ACCUMULATOR_BYTES, SCHEDULE_MEMORY_PARTS, BlockActivationTerms, StageConfig, StageLayout,
                     acts_per_microbatch, greedy_offload, stage_memory, state_bytes_per_param, tied_unit)
from .op_time import matmul_time, op_class_time
from .overlap import overlap_where_busy
from .policy_terms import EAGER_LAYER, EAGER_SEQUENCE_LAYER, PolicyTerms, policy_layers_eager
from .stage_api import LOSS_FUSED, LOSS_PLAIN, StageCandidates, StageEstimates
from .state_traffic import (AUTOGRAD_ACCUMULATE_PASSES, accumulation_bytes_moved, grad_buffer_bytes_moved,
                            low_precision_bytes_moved, offloaded_grad_bytes, optimizer_phase_s, step_grads_to_device)

# stable times of the plain and the fused loss this close are equal (the overlap simulation rounds: a
# plain loss computing less can come out an ulp slower where its compute hides under communication)
LOSS_TIE = 1e-12
MAX_MICRO_BATCH = 1 << 20  # the largest micro-batch (sequences) and group size the cost model prices
MAX_GROUP = 1 << 14


def _warm_up_candidate() -> StageCandidates:
    return StageCandidates(num_layers=1, has_pre=True, has_post=True, nodes=1, gpus_per_node=2, micro_batch=1, dp=1,
                           tp=2, zero=3, ckpt_layers=1, offload_weights=0.5, offload_grads=0.5, offload_opt=0.5,
                           offload_acts=0.5, inflight=1)


@dataclass
class StageCostModel(PolicyTerms):
    """Vectorised stage evaluator (implements ``stage_api.StageCostModel``)."""

    blocks: dict[str, BlockAnalysis]
    hardware: HardwareProfile
    seq_len: int
    dtype: str = DEFAULT_DTYPE
    attention: str = "flash"
    model_name: str = ""
    num_layers: int = 0
    grad_dtype: str = "float32"  # the plan's grad_dtype: the dtype ZeRO 0/1 keep gradients in, for every candidate
    compiled: bool = COMPILED_DEFAULT  # prices the units as compiled code (``cost.compiled``), else the eager program
    _functions: dict[str, BlockFunctions] = field(default_factory=dict, repr=False)
    # caches, per model (``dataclasses.replace``, e.g. with another profile, starts them afresh): the block terms
    # of a (b, t, TP group) key, and the term arrays of a set of distinct keys
    _terms_cache: dict[int, dict] = field(default_factory=dict, init=False, repr=False)
    _tables_cache: dict[bytes, dict] = field(default_factory=dict, init=False, repr=False)
    # per-tensor activation policies candidates may use (``act_policy`` indexes it), priced on the layer's table
    policies: list = field(default_factory=list, repr=False)
    _policy_prices: dict = field(default_factory=dict, init=False, repr=False)  # (index, sp) -> PolicyPrice
    _policy_cache: dict = field(default_factory=dict, init=False, repr=False)  # (index, b, t, sp) -> terms

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise StageModelError(f"attention must be one of {list(ATTENTION_KERNELS)}, got {self.attention!r}")
        state_bytes_per_param(self.dtype)
        if self.grad_dtype not in ("float32", self.dtype):
            raise StageModelError(f"grad_dtype must be 'float32' or the dtype {self.dtype!r}, got {self.grad_dtype!r}")
        missing = [kind for kind in BLOCK_KINDS if kind not in self.blocks]
        if missing:
            raise StageModelError(f"model analysis lacks block kind(s) {missing}")
        self._functions = {kind: block_functions(block, self.attention) for kind, block in self.blocks.items()}
        if self.blocks["layer"].sequence is not None:  # the layer as sequence parallelism runs it
            self._functions[SEQUENCE_LAYER] = block_functions(self.blocks["layer"].sequence, self.attention)
        eager = self.blocks["layer"].eager if self.compiled else None
        if eager is not None:  # the layer as its eager program runs it: what a unit with a per-tensor policy runs
            self._functions[EAGER_LAYER] = block_functions(eager, self.attention)
            if eager.sequence is not None and SEQUENCE_LAYER in self._functions:
                self._functions[EAGER_SEQUENCE_LAYER] = block_functions(eager.sequence, self.attention)
        self.evaluate(_warm_up_candidate())  # first-call costs of numpy/lambdify paid here, not by the tuner

    @property
    def device_memory_bytes(self) -> float:
        """The bytes a stage may use: the profile's usable memory (headroom or ``--memory-limit`` applied)."""
        return self.hardware.usable_memory

    @property
    def tp_supported(self) -> bool:
        return all(block.tp_supported for block in self.blocks.values())

    @property
    def tp_message(self) -> str:
        return "; ".join(f"{kind}: {block.tp_message}" for kind, block in self.blocks.items() if not block.tp_supported)

    @property
    def tp_granularity(self) -> int:
        """Tensor-parallel degrees must divide this (attention heads, sharded weight dimensions)."""
        return math.gcd(*(block.tp_granularity for block in self.blocks.values() if not block.tp_optional))

    def model_flops_per_sequence(self) -> float:
        """Model FLOPs of one sequence of ``seq_len`` tokens, forward and backward (``cost.flops``): three
        times the forward FLOPs of the pre block, every layer and the post block, on one device, no
        recomputation counted. Every one of them is priced at most at the profile's peak."""
        one = np.ones(1)
        counts = {"pre": 1, "layer": self.num_layers, "post": 1}
        forward = sum(count * sum(float(f(one, self.seq_len * one, one)[0])
                                  for f in self._functions[kind].flops["forward"].values())
                      for kind, count in counts.items())
        return 3.0 * forward

    def _unhidden_zero_traffic(self, c, pre, layer, post, zero, weight_b, grad_b, dp_links, gather, scatter,
                               borrowed_unit):
        """ZeRO collectives of a micro-batch that no compute hides, as the runtime orders them (it
        prefetches one unit ahead and finishes one reduction before it launches the next): (forward
        gathers, backward gathers, backward reduce-scatters), each at most the phase's whole traffic.

        - forward: the first unit's gather; a stage with the pre block, the first layer's too, past
          the pre block's own (embedding) compute it was prefetched behind; the post block's gather,
          which nothing before it prefetches;
        - backward: the gather of the unit whose backward comes first; the post block's reduction,
          finished when its last unit (a norm, light) is done; the first layer's past the pre block's
          backward; the first unit's, finished before the next micro-batch (or the step) begins.
        """
        blocks = {"pre": pre, "layer": layer, "post": post}
        needed = {"pre": pre["params"], "layer": layer["params"], "post": post["params"] + borrowed_unit}  # (a tied head)
        gathered = {kind: collective_seconds(self.hardware, "all_gather", elements * weight_b, dp_links)
                    for kind, elements in needed.items()}
        scattered = {kind: collective_seconds(self.hardware, "reduce_scatter", terms["params"] * grad_b, dp_links)
                     for kind, terms in blocks.items()}
        has_pre = np.asarray(c.has_pre, dtype=float)
        has_post = np.asarray(c.has_post, dtype=float)
        layers = (np.asarray(c.num_layers) > 0).astype(float)

        def first(times):  # the unit that starts the forward (and ends the backward)
            return np.where(has_pre > 0, times["pre"], times["layer"])

        forward = (first(gathered) + has_pre * layers * np.maximum(0.0, gathered["layer"] - pre["forward_compute"])
                   + has_post * gathered["post"])
        backward_gather = np.where(has_post > 0, gathered["post"], gathered["layer"])
        backward_scatter = (first(scattered) + has_post * scattered["post"]
                            + has_pre * layers * np.maximum(0.0, scattered["layer"] - pre["backward_compute"]))
        z3, z2 = zero >= 3, zero >= 2
        return (np.where(z3, np.minimum(gather, forward), 0.0), np.where(z3, np.minimum(gather, backward_gather), 0.0),
                np.where(z2, np.minimum(scatter, backward_scatter), 0.0))

    def _overflow_check_s(self, shard_params: np.ndarray) -> np.ndarray:
        """fp16 dynamic loss scaling (``runtime.loss_scaling``): one read pass over this rank's reduced
        fp32 gradients per step to find inf/NaN (the unscaling rides on the reduction cast, the flag on
        the loss's all-reduce); other dtypes: nothing."""
        if self.dtype != "float16":
            return np.zeros(np.shape(shard_params))
        return op_class_time(self.hardware, self.dtype, "reduction", 0.0, 4.0 * np.asarray(shard_params, dtype=float))

    # ---- per distinct (b, t, nodes, gpus) quantities -------------------------------------------

    @property
    def sp_supported(self) -> bool:
        return SEQUENCE_LAYER in self._functions

    def _block_terms(self, kind: str, b: np.ndarray, t: np.ndarray, tp_shape) -> dict[str, np.ndarray]:
        functions = self._functions[kind]
        if functions.tp_optional and functions.tp_granularity:  # the lowering keeps it whole then
            t = np.where(functions.tp_granularity % t == 0, t, 1.0)
        s = np.full(b.shape, float(self.seq_len))
        terms: dict[str, np.ndarray] = {}
        by_shape = self.hardware.matmul_model is not None  # GEMMs priced one by one, by their shape
        for phase in ("forward", "backward", "weight"):
            time = np.zeros(b.shape)
            for op_class, flops in functions.flops[phase].items():
                if by_shape and op_class == "matmul":
                    continue
                time = time + op_class_time(self.hardware, self.dtype, op_class, flops(b, s, t),
                                            functions.nbytes[phase][op_class](b, s, t))
            if by_shape:
                for flops, nbytes in functions.gemms[phase]:
                    time = time + matmul_time(self.hardware, self.dtype, flops(b, s, t), nbytes(b, s, t))
            terms[f"{phase}_compute"] = time + functions.op_count[phase] * self.hardware.op_overhead
            comm = np.zeros(b.shape)
            for collective, payload in functions.collectives[phase]:
                comm = comm + collective_time(self.hardware, collective, np.maximum(payload(b, s, t), 0.0), *tp_shape)
            terms[f"{phase}_tp"] = np.where(t > 1, comm, 0.0)
        terms["stash"] = functions.stash(b, s, t)
        terms["saved"] = functions.saved(b, s, t)
        terms["input"] = functions.input(b, s, t)
        terms["output"] = functions.output(b, s, t)
        def largest(candidates):  # a block's peak over its candidate points (none: zero)
            return np.max(np.stack([f(b, s, t) for f in candidates]), axis=0) if candidates else np.zeros(b.shape)
        terms["forward_peak"] = largest(functions.forward_peaks)
        terms["backward_peak"] = largest(functions.backward_peaks)
        terms["backward_peak_apart"] = largest(functions.backward_peaks_apart or functions.backward_peaks)
        for name in ("forward_peaks_weights_free", "backward_peaks_weights_free"):
            terms[name] = largest(getattr(functions, name))
        terms["params"] = functions.params_per_device(b, s, t)
        terms["unit_0"], terms["unit_1"] = (unit(b, s, t) for unit in functions.units)
        terms["borrowed"] = functions.borrowed(b, s, t)
        for index, (size, movable) in enumerate(zip(functions.saved_sequence, functions.saved_offloadable)):
            terms[f"saved_{index}"] = size(b, s, t)
            terms[f"movable_{index}"] = np.full(b.shape, float(movable))
        if functions.loss is not None:
            deltas = plain_loss_deltas(*(f(b, s, t) for f in functions.loss), functions.loss_dtype_bytes,
                                       self.hardware, self.dtype)
            for name, value in vars(deltas).items():
                terms[f"plain_loss_{name}"] = value
        return terms

    def _sequence_terms(self, b: np.ndarray, t: np.ndarray, tp_shape) -> dict[str, dict[str, np.ndarray]]:
        """Per block terms of sequence-parallel stages: the layer as ``sp_pricing`` priced it, the hidden
        state gathered before the head (forward) and after the embedding (its gradient, backward)."""
        terms = {kind: self._block_terms(kind, b, t, tp_shape) for kind in ("pre", "post")}
        terms["layer"] = self._block_terms(SEQUENCE_LAYER, b, t, tp_shape)
        if EAGER_SEQUENCE_LAYER in self._functions:
            terms[EAGER_LAYER] = self._block_terms(EAGER_SEQUENCE_LAYER, b, t, tp_shape)
        whole = self._block_terms("layer", b, t, tp_shape)["output"]
        gather = np.where(t > 1, collective_time(self.hardware, "all_gather", whole, *tp_shape), 0.0)
        terms["post"]["forward_tp"] = terms["post"]["forward_tp"] + gather
        terms["pre"]["backward_tp"] = terms["pre"]["backward_tp"] + gather
        return terms

    def _candidate_terms(self, c: StageCandidates):
        """Per-block terms for every candidate (computed once per distinct (b, tp, TP group shape)),
        and the data-parallel group shape."""
        b = np.asarray(c.micro_batch, dtype=np.int64)
        tp = np.asarray(c.tp, dtype=np.int64)
        sp = (np.asarray(c.sp, dtype=bool) & (tp > 1) & self.sp_supported).astype(np.int64)
        (tp_nodes, tp_gpus), dp_shape = group_shapes(tp, np.asarray(c.dp, dtype=np.int64),
                                                      np.asarray(c.nodes, dtype=np.int64),
                                                      np.asarray(c.gpus_per_node, dtype=np.int64))
        if len(c) and (b.max() >= MAX_MICRO_BATCH or tp.max() >= MAX_GROUP // 2 or tp_nodes.max() >= MAX_GROUP
                       or tp_gpus.max() >= MAX_GROUP):  # (tp shares its bits with the sp flag)
            raise StageModelError(f"micro_batch must be < {MAX_MICRO_BATCH}, tp < {MAX_GROUP // 2} and nodes, "
                                  f"gpus_per_node < {MAX_GROUP} (the cost model's range)")
        keys = ((b << 42) | (((tp << 1) | sp) << 28) | (tp_nodes << 14) | tp_gpus).astype(np.int64)
        unique_keys, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        missing = np.array([int(key) not in self._terms_cache for key in unique_keys], dtype=bool)
        if missing.any():  # block terms depend only on the key: computed once per model, then reused
            for with_sp in (0, 1):
                pick = first[missing & (sp[first] == with_sp)]
                if not len(pick):
                    continue
                shape = (tp_nodes[pick], tp_gpus[pick])
                batch, degree = b[pick].astype(float), tp[pick].astype(float)
                if with_sp:
                    fresh = self._sequence_terms(batch, degree, shape)
                else:
                    fresh = {kind: self._block_terms(kind, batch, degree, shape)
                             for kind in self._functions if kind not in (SEQUENCE_LAYER, EAGER_SEQUENCE_LAYER)}
                    fresh["layer"] = costliest_layer([terms for kind, terms in fresh.items() if kind.startswith("layer")])
                for i, key in enumerate(keys[pick]):
                    self._terms_cache[int(key)] = {kind: {name: value[i] for name, value in terms.items()}
                                                   for kind, terms in fresh.items()}
        if not len(unique_keys):
            return {kind: {name: np.zeros(0) for name in self._block_terms(kind, np.zeros(0), np.zeros(0),
                                                                           (np.zeros(0, int), np.zeros(0, int)))}
                    for kind in BLOCK_KINDS}, dp_shape
        tables = self._tables_cache.get(unique_keys.tobytes())
        if tables is None:  # (the tuner asks about the same keys many times: corners of one set of bases)
            cached = [self._terms_cache[int(key)] for key in unique_keys]
            kinds = BLOCK_KINDS + ((EAGER_LAYER,) if all(EAGER_LAYER in entry for entry in cached) else ())
            tables = {kind: {name: np.array([entry[kind].get(name, 0.0) for entry in cached])
                             for name in set().union(*(entry[kind] for entry in cached))} for kind in kinds}
            if len(self._tables_cache) >= 4096:
                self._tables_cache.clear()
            self._tables_cache[unique_keys.tobytes()] = tables
        per_kind = {kind: {name: values[inverse] for name, values in terms.items()} for kind, terms in tables.items()}
        return policy_layers_eager(per_kind, c), dp_shape

    def _infeasible(self, tp: np.ndarray, present: dict[str, np.ndarray]) -> np.ndarray:
        """Tensor parallelism on a structure the sharding rules do not know, or a degree that
        does not divide the heads / sharded dimensions."""
        infeasible = np.zeros(len(tp), dtype=bool)
        for kind, functions in self._functions.items():
            if kind in (SEQUENCE_LAYER, EAGER_LAYER, EAGER_SEQUENCE_LAYER):  # priced apart; feasible where the layer is
                continue
            here = present[kind.partition("#")[0]]  # every layer class counts wherever layers are
            if not functions.tp_supported:
                infeasible |= here & (tp > 1)
            elif functions.tp_granularity and not functions.tp_optional:
                infeasible |= here & (functions.tp_granularity % tp != 0)
        return infeasible

    def _unsupported(self, c: StageCandidates) -> np.ndarray:
        """Candidates the stage cannot run: ``_infeasible`` tensor parallelism, or sequence parallelism
        without tp > 1 and the sequence split evenly."""
        present = {"layer": np.asarray(c.num_layers) > 0, "pre": np.asarray(c.has_pre, dtype=bool),
                   "post": np.asarray(c.has_post, dtype=bool)}
        unsupported = self._infeasible(np.asarray(c.tp, dtype=np.int64), present)
        asked_sp = np.asarray(c.sp, dtype=bool)
        return unsupported | (asked_sp & ((np.asarray(c.tp) <= 1) | (self.seq_len % np.asarray(c.tp) != 0)
                                          | (not self.sp_supported)))

    def evaluate(self, candidates: StageCandidates, breakdown: bool = True) -> StageEstimates:
        """Every candidate's time and memory; a last stage's head + loss priced as its ``fused_loss``
        says, or (``-1``) both ways, keeping the plain loss where it fits and is faster
        (``breakdown["fused_loss"]``: 1.0 fused, 0.0 plain; with ``breakdown=False`` the only part)."""
        per_kind, dp_shape = self._candidate_terms(candidates)
        fused = self._estimate(candidates, per_kind, dp_shape, breakdown)
        fused.breakdown["fused_loss"] = np.ones(len(candidates))
        choice = np.asarray(candidates.fused_loss)
        wanted = _plain_loss_rows(candidates, per_kind)
        if not len(wanted):
            return fused
        subset = _with_plain_loss(per_kind, wanted)
        plain = self._estimate(candidates.select(wanted), subset, tuple(part[wanted] for part in dp_shape), breakdown)
        better = (choice[wanted] == LOSS_PLAIN) | ((plain.peak_memory_bytes <= self.device_memory_bytes)
                                             & (plain.stable_s <= fused.stable_s[wanted] * (1.0 + LOSS_TIE)))
        chosen = wanted[better]
        fused.stable_s[chosen] = plain.stable_s[better]
        fused.delta_s[chosen] = plain.delta_s[better]
        fused.peak_memory_bytes[chosen] = plain.peak_memory_bytes[better]
        for name, values in plain.breakdown.items():
            fused.breakdown[name] = np.broadcast_to(np.asarray(fused.breakdown[name], dtype=float),
                                                    (len(candidates),)).copy()
            fused.breakdown[name][chosen] = np.broadcast_to(np.asarray(values, dtype=float), (len(wanted),))[better]
        fused.breakdown["fused_loss"][chosen] = 0.0
        return fused

    def totals(self, candidates: StageCandidates) -> StageEstimates:
        """``evaluate`` without the breakdown: what the tuner reads (times and peaks)."""
        return self.evaluate(candidates, breakdown=False)

    def peak_memory(self, candidates: StageCandidates, opt_ratios: tuple[float, ...] | None = None) -> np.ndarray:
        """``evaluate(candidates).peak_memory_bytes``, timing only what the loss choice needs: a plain loss
        that fits, computes no more than the fused one and offloads no activations by fraction is taken
        (its stable time can only be lower: overlap is monotone in compute); other rows where it fits
        are timed both ways. ``opt_ratios``: the peaks with each of these optimizer-offload ratios
        instead of the candidates' own, (ratios, candidates), the program points summed once."""
        ratios = (None,) if opt_ratios is None else tuple(float(r) for r in opt_ratios)
        count = len(candidates)
        per_kind, dp_shape = self._candidate_terms(candidates)
        peak = self._memory(candidates, per_kind, peak_only=True, opt_ratios=opt_ratios)[0].peak
        peaks = np.broadcast_to(np.asarray(peak, dtype=float), (len(ratios), count)).copy()
        choice = np.broadcast_to(np.asarray(candidates.fused_loss), (count,))
        wanted = _plain_loss_rows(candidates, per_kind)
        if len(wanted):
            post = per_kind["post"]
            # (offloaded activations move the post block's saved tensors too, unless a per-tensor policy says what moves)
            quicker = ((post["plain_loss_forward_compute"][wanted] <= 0) & (post["plain_loss_backward_compute"][wanted] <= 0)
                       & ((np.asarray(candidates.offload_acts, dtype=float)[wanted] == 0)
                          | (np.asarray(candidates.act_policy)[wanted] >= 0)))
            subset = _with_plain_loss(per_kind, wanted)
            chosen = candidates.select(wanted)
            plain = np.broadcast_to(np.asarray(self._memory(chosen, subset, True, opt_ratios)[0].peak, dtype=float),
                                    (len(ratios), len(wanted)))
            forced = choice[wanted] == LOSS_PLAIN
            fits = plain <= self.device_memory_bytes
            no_slower = quicker.copy()
            unsure = np.flatnonzero(~forced & ~quicker & fits.any(axis=0))
            if len(unsure):  # evaluate's rule from the stable times alone (the optimizer ratio does not move them)
                rows = wanted[unsure]
                check, shape = candidates.select(rows), tuple(part[rows] for part in dp_shape)
                fused_s, plain_s = (self._estimate(check, _take_rows(kinds, pick), shape, False, True).stable_s
                                    for kinds, pick in ((per_kind, rows), (subset, unsure)))
                no_slower[unsure] = plain_s <= fused_s * (1.0 + LOSS_TIE)
            take = forced | (fits & no_slower)
            for i in range(len(ratios)):
                peaks[i, wanted[take[i]]] = plain[i, take[i]]
        peaks = np.where(self._unsupported(candidates), np.inf, peaks)
        return peaks[0] if opt_ratios is None else peaks

    def _memory(self, c: StageCandidates, per_kind: dict, peak_only: bool = False, opt_ratios=None,
                times_only: bool = False):
        """The stage's memory (``cost.memory``; None with ``times_only``), a micro-batch's activations
        and the per-tensor policy terms; ``peak_only``: the peak alone (``StageMemory.peak``, the parts
        at the peak point left out), for each of ``opt_ratios`` if given."""
        layer, pre, post = per_kind["layer"], per_kind["pre"], per_kind["post"]
        n = np.asarray(c.num_layers, dtype=float)
        has_pre = np.asarray(c.has_pre, dtype=float)
        has_post = np.asarray(c.has_post, dtype=float)
        _, grad_b, _ = state_bytes_per_param(self.dtype)
        zero = np.asarray(c.zero)
        # low-precision gradients (ZeRO 0/1 keep them in the param dtype): the plan's or the candidate's
        low_grads = ((np.asarray(c.low_precision_grads, dtype=bool) | (self.grad_dtype != "float32"))
                     & (zero <= 1) & (grad_b < 4.0) & (np.asarray(c.offload_grads, dtype=float) == 0))
        # units: the post block's backward ends with its first unit in forward order (the final norm), the pre
        # block's with its first (the token embedding), after its second (the positions)
        layout = StageLayout(pre["params"], layer["params"], post["params"], n, has_pre, has_post,
                             post_last=post["unit_0"], pre_last=pre["unit_0"], pre_previous=pre["unit_1"],
                             tied=post["borrowed"])
        config = StageConfig(self.dtype, c.zero, np.asarray(c.dp, dtype=np.int64), c.grad_accum, c.inflight,
                             np.asarray(c.ckpt_layers, dtype=float), c.offload_weights, c.offload_grads,
                             c.offload_opt, c.offload_acts, self.hardware.reduce_scatter_copies,
                             low_precision_grads=low_grads)
        terms = {kind: BlockActivationTerms(v["saved"], v["input"], v["forward_peak"], v["backward_peak"],
                                            v["forward_peaks_weights_free"], v["backward_peaks_weights_free"],
                                            v["output"], v.get("backward_peak_apart"))
                 for kind, v in per_kind.items()}
        saved_count = sum(1 for name in layer if name.startswith("saved_"))  # (the two layer variants differ)
        layer_offloaded = greedy_offload([layer[f"saved_{i}"] for i in range(saved_count)],
                                         [layer[f"movable_{i}"] > 0 for i in range(saved_count)],
                                         np.asarray(c.offload_acts, dtype=float))
        # a per-tensor policy: what its layers keep and offload replaces the layer's saved bytes and the plain rule
        act = np.asarray(c.act_policy, dtype=np.int64)
        policy = self._policy_terms(act, np.asarray(c.micro_batch, dtype=np.int64), np.asarray(c.tp, dtype=np.int64),
                                    (np.asarray(c.sp, dtype=bool) & self.sp_supported).astype(np.int64))
        with_policy = act >= 0
        terms["layer"].saved = np.where(with_policy, policy["kept"] + policy["offloaded"], terms["layer"].saved)
        layer_offloaded = np.where(with_policy, policy["offloaded"], layer_offloaded)
        if times_only:
            return None, acts_per_microbatch(layout, config, terms["pre"], terms["layer"], terms["post"]), policy, \
                with_policy, low_grads
        memory = stage_memory(layout, config, terms["pre"], terms["layer"], terms["post"], layer_offloaded,
                              peak_only=peak_only, opt_ratios=opt_ratios)
        return memory, memory.acts_per_microbatch, policy, with_policy, low_grads

    def _estimate(self, c: StageCandidates, per_kind: dict, dp_shape: tuple, breakdown: bool = True,
                  times_only: bool = False) -> StageEstimates:
        """Times and memory (``times_only``: times, the peak left NaN; ``breakdown``: the parts too)."""
        count = len(c)
        dp = np.asarray(c.dp, dtype=np.int64)
        nodes = np.asarray(c.nodes, dtype=np.int64)
        dp_nodes, dp_gpus = dp_shape
        layer, pre, post = per_kind["layer"], per_kind["pre"], per_kind["post"]
        n = np.asarray(c.num_layers, dtype=float)
        ckpt = np.asarray(c.ckpt_layers, dtype=float)
        has_pre = np.asarray(c.has_pre, dtype=float)
        has_post = np.asarray(c.has_post, dtype=float)

        def stage_sum(name: str) -> np.ndarray:
            return n * layer[name] + has_pre * pre[name] + has_post * post[name]

        weight_b, grad_b, _ = state_bytes_per_param(self.dtype)
        zero = np.asarray(c.zero)
        stage_params = stage_sum("params")
        memory, acts_per_mb, policy, with_policy, low_grads = self._memory(c, per_kind, peak_only=not breakdown,
                                                                         times_only=times_only)
        peak = memory.peak if memory is not None else np.full(count, np.nan)

        # ---- stable phase: one micro-batch forward + backward ----------------------------------
        weight_bytes = stage_params * weight_b
        grad_bytes = stage_params * grad_b
        forward_compute = stage_sum("forward_compute")
        recompute = ckpt * layer["forward_compute"] + (n - ckpt) * policy["recompute"]
        # zeroing and scaling pass over whole buffers no cache holds; autograd adds each gradient as the
        # backward makes it (the new gradient is still in cache)
        grad_buffer_s = (np.where(low_grads, 0.0, grad_buffer_bytes_moved(grad_bytes, dp)) / self.hardware.state_pass_bandwidth
                         + op_class_time(self.hardware, self.dtype, "elementwise", 0.0,
                                         AUTOGRAD_ACCUMULATE_PASSES * grad_bytes))
        backward_compute = stage_sum("backward_compute") + recompute + grad_buffer_s
        tp_exposed = stage_sum("forward_tp") + stage_sum("backward_tp") + ckpt * layer["forward_tp"]
        dp_links = group_links(self.hardware, dp_nodes, dp_gpus)  # looked up once for the stage's collectives
        borrowed_unit = tied_unit(has_pre, has_post, post["borrowed"], pre["unit_0"])  # gathered for the head too
        gather = collective_seconds(self.hardware, "all_gather", (stage_params + borrowed_unit) * weight_b, dp_links)
        scatter = collective_seconds(self.hardware, "reduce_scatter", grad_bytes, dp_links)
        all_reduce = collective_seconds(self.hardware, "all_reduce", grad_bytes, dp_links)
        forward_edge, backward_edge_gather, backward_edge_scatter = self._unhidden_zero_traffic(
            c, pre, layer, post, zero, weight_b, grad_b, dp_links, gather, scatter, borrowed_unit)
        forward_collective = np.where(zero >= 3, gather - forward_edge, 0.0)
        backward_collective = (np.where(zero >= 3, gather - backward_edge_gather, 0.0)
                               + np.where(zero >= 2, scatter - backward_edge_scatter, 0.0))
        weight_share = np.where(zero >= 3, 1.0 / dp, 1.0)
        offload_w = np.asarray(c.offload_weights, dtype=float)
        offload_g = np.asarray(c.offload_grads, dtype=float)
        offload_a = np.asarray(c.offload_acts, dtype=float)
        offload_o = np.asarray(c.offload_opt, dtype=float)
        weights_in = copy_time(self.hardware, offload_w * weight_bytes * weight_share, "h2d")
        grads_to_host, grads_back = offloaded_grad_bytes(stage_params, offload_g, zero, dp, c.grad_accum)
        grads_out = copy_time(self.hardware, grads_to_host, "d2h")
        grads_in = copy_time(self.hardware, grads_back, "h2d")
        ckpt_moved = np.where(offload_a >= 1.0, ckpt * layer["input"], 0.0)  # with a policy: the checkpointed inputs
        acts_moved = np.where(with_policy, (n - ckpt) * policy["offloaded"] + ckpt_moved, offload_a * acts_per_mb)
        acts_out = copy_time(self.hardware, acts_moved, "d2h")
        acts_in = copy_time(self.hardware, acts_moved, "h2d")
        inter_node = nodes > 1
        p2p_bytes = (1.0 - has_post) * layer["output"] + (1.0 - has_pre) * layer["input"]
        p2p = p2p_time(self.hardware, p2p_bytes, inter_node)
        forward = overlap_where_busy(self.hardware, forward_compute, forward_collective, weights_in, acts_out)
        backward = overlap_where_busy(self.hardware, backward_compute, backward_collective,
                                      weights_in + acts_in + grads_in, grads_out)
        forward_s = forward.total_s + forward_edge
        backward_s = backward.total_s + backward_edge_gather + backward_edge_scatter
        stable = forward_s + backward_s + tp_exposed + p2p

        # ---- delta: once per iteration ---------------------------------------------------------
        sync = np.where(zero == 0, all_reduce, np.where(zero == 1, scatter, 0.0))
        after_step_gather = np.where((zero == 1) | (zero == 2), gather, 0.0)
        opt_share = np.where(zero >= 1, 1.0 / dp, 1.0)
        shard_params = stage_params * opt_share
        device_step = (1.0 - offload_o) * shard_params / self.hardware.device_adam_params_per_s
        host_step = offload_o * shard_params / self.hardware.host_adam_params_per_s
        step_out = copy_time(self.hardware, offload_o * shard_params * grad_b, "d2h")
        step_in = copy_time(self.hardware, offload_o * shard_params * weight_b, "h2d")
        step_grads_in = copy_time(self.hardware, step_grads_to_device(offload_g, offload_o, zero) * shard_params
                                  * ACCUMULATOR_BYTES, "h2d")
        accumulate = np.where(low_grads, low_precision_bytes_moved(grad_bytes, stage_params, zero, dp),
                              accumulation_bytes_moved(stage_params, zero, dp, c.grad_accum)) / self.hardware.state_pass_bandwidth
        device_and_copies = overlap_where_busy(self.hardware, device_step, np.zeros(count), step_in + step_grads_in,
                                               step_out).total_s
        step = optimizer_phase_s(device_and_copies,
                                 host_step, step_out, step_in, n + has_pre + has_post) + accumulate
        delta = sync + step + after_step_gather + self._overflow_check_s(shard_params)

        unsupported = self._unsupported(c)
        stable = np.where(unsupported, np.inf, stable)
        peak = np.where(unsupported, np.inf, peak)

        if not breakdown:
            return StageEstimates(stable_s=stable, delta_s=delta, peak_memory_bytes=peak)
        compute = forward_compute + backward_compute
        breakdown = {
            "compute": compute,
            "recompute": recompute,
            "forward": forward_s,
            "backward": backward_s,
            "tp_comm": tp_exposed,
            "tp_forward": stage_sum("forward_tp"),
            "p2p": p2p,
            "p2p_message": p2p_time(self.hardware, (1.0 - has_post) * layer["output"], inter_node),  # one, over the next cut
            # the backward's weight half (compute) and what it keeps from the input half: units with
            # tensor-parallel collectives keep their backward whole (passes/split_backward.py)
            "backward_weight": np.where(np.asarray(c.tp) > 1, 0.0, stage_sum("weight_compute")),
            "weight_stash": np.where(np.asarray(c.tp) > 1, 0.0, stage_sum("stash")),
            # a weight half returns its unit's gradients together, beside the buffer they are added to (an
            # eager backward makes them one parameter at a time; a compiled unit's backward is priced so);
            # counted for chunks of layers only: with the pre or post block, the backward's peak the weight
            # half is priced from is that block's (the embedding's gradient, the loss), above a layer's
            "weight_half_grads": np.where((np.asarray(c.tp) > 1) | (n <= 0) | (has_pre > 0) | (has_post > 0)
                                          | (self.compiled & ~with_policy), 0.0, layer["params"] * grad_b),
            "exposed_comm": (forward.exposed_s["collective"] + backward.exposed_s["collective"] + forward_edge
                             + backward_edge_gather + backward_edge_scatter + tp_exposed + p2p),
            "exposed_copy": (forward.exposed_s["h2d"] + forward.exposed_s["d2h"]
                             + backward.exposed_s["h2d"] + backward.exposed_s["d2h"]),
            "grad_sync": sync + after_step_gather,
            "optimizer": step,
            "params": memory.weights,
            "grads": memory.grads,
            "opt": memory.opt,
            "buffers": memory.buffers,
            "acts": memory.acts,
            "acts_per_microbatch": acts_per_mb,
            "peak_forward_backward": np.where(unsupported, np.inf, memory.peak_forward_backward),
            # for a schedule's walk over its actions (cost/schedule_memory.py)
            **{name: getattr(memory, name) for name in SCHEDULE_MEMORY_PARTS},
        }
        return StageEstimates(stable_s=stable, delta_s=delta, peak_memory_bytes=peak, breakdown=breakdown)


def _plain_loss_rows(candidates: StageCandidates, per_kind: dict) -> np.ndarray:
    """Candidates that may take the plain loss: last stages not held to the fused one, of a model whose
    analysis priced both."""
    choice = np.broadcast_to(np.asarray(candidates.fused_loss), (len(candidates),))
    return np.flatnonzero(np.asarray(candidates.has_post, dtype=bool) & (choice != LOSS_FUSED)
                          & ("plain_loss_saved" in per_kind["post"]))


def _take_rows(per_kind: dict, rows: np.ndarray) -> dict:
    """The per-block terms of some candidates."""
    return {kind: {name: value[rows] for name, value in terms.items()} for kind, terms in per_kind.items()}


def _with_plain_loss(per_kind: dict, rows: np.ndarray) -> dict:
    """The per-block terms of ``rows`` with the post block's head and loss priced plain."""
    subset = _take_rows(per_kind, rows)
    post = subset["post"]
    for name in ("forward_compute", "backward_compute", "saved", "forward_peak", "backward_peak"):
        post[name] = post[name] + post[f"plain_loss_{name}"]
    return subset


def build_stage_cost_model(program: MistProgram, hardware, *, seq_len: int, dtype: str | None = None,
                           attention: str = "flash", grad_dtype: str = "float32",
                           compiled: bool = COMPILED_DEFAULT) -> StageCostModel:
    """Analyse a captured program once; return the vectorised stage model.

    ``hardware``: a profile name/path or a :class:`HardwareProfile`; ``dtype``: the training dtype
    (default: the program's, which is what its graphs were traced in); ``grad_dtype``: the plans'
    gradient dtype (``float32`` or ``dtype``: low-precision gradients for ZeRO 0/1, every candidate);
    ``compiled``: price each unit as the compiled code the runtime runs (``cost.compiled``: what
    inductor's partitioner saves, fused elementwise kernels) rather than the eager program.
    """
    if not isinstance(program, MistProgram):
        raise StageModelError(f"the stage cost model prices a captured program (driver.capture), not "
                              f"{type(program).__name__}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise StageModelError(f"seq_len must be a positive integer, got {seq_len!r}")
    if attention not in ATTENTION_KERNELS:
        raise StageModelError(f"attention must be one of {list(ATTENTION_KERNELS)}, got {attention!r}")
    dtype = dtype or program.dtype
    state_bytes_per_param(dtype)
    profile = hardware if isinstance(hardware, HardwareProfile) else load_profile(hardware)
    (blocks, num_layers), name = analyse_program(program, compiled=compiled), program.model_name
    return StageCostModel(blocks, profile, seq_len, dtype, attention, model_name=name, num_layers=num_layers,
                          grad_dtype=grad_dtype, compiled=compiled)
