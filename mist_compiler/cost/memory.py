"""Stage memory: the backend's memory timeline in closed form over the per-block symbolic analysis.

The inner terms come from the memory-analysis pass (per block class, symbolic in b, s, t and
evaluated per candidate): saved activations ``A`` per micro-batch, the block input ``I``, and the
peaks of live activation memory inside the block's forward and backward, split by whether the
block's weights are in use there (``BlockActivationTerms``). The outer terms follow what the
backend (``runtime/zero.py``, one flat bucket per unit) holds at each point of a step:

- **static** (the whole step): the weights (ZeRO-3: the ``1/dp`` shard; a weight-offload fraction
  ``w`` lives on the host), the fp32 master (none when fp32 weights are the master) and the two
  Adam moments, ``1/dp`` from ZeRO-1 on, an ``opt`` fraction on the host;
- **transient weights**: under ZeRO-3 or weight offload a block's full weights are materialised
  for its forward and backward with the next block's prefetched (pre: itself + a layer; layer:
  two layers; the post block: itself, whose loss runs after its head is released); a unit's
  weights are released when its backward is done, and the backward prefetches one unit ahead,
  so the pre block's backward holds only its own units (the token embedding's alone at its end);
- **gradients**, allocated when a block's backward begins: the block's micro-batch gradient
  buffer (param dtype, plus an fp32 reduction copy in mixed precision) while its backward runs;
  the reduced gradient each finished block keeps until the step (ZeRO-0: all of it; ZeRO-1: the
  ``1/dp`` shard; ZeRO-2/3: the ``1/dp`` accumulator); with gradient accumulation an fp32
  accumulator per block between micro-batches (ZeRO-0/1: full, ZeRO-2/3: ``1/dp``; a ``grads``
  offload fraction of it on the host), present in the forwards that follow a backward, and the
  backwards between the first and the last keep every accumulator as it is. With
  ``low_precision_grads`` (plan ``grad_dtype`` = the param dtype) ZeRO-0/1 keep the micro-batch
  buffer itself between micro-batches (param dtype, no fp32 copy until the last micro-batch's
  reduction; ZeRO-1 then trades it for the fp32 shard, ZeRO-0 keeps it until the step);
- **activations** under 1F1B: ``inflight`` micro-batches are alive at once (stage i of S holds
  S-i). A checkpointed layer keeps only its input ``I``; its activations come back during its
  backward. Activation offload keeps ``1 - acts`` of the saved activations of every block other
  than the one running (and the one prefetched back for the backward) on the device;
- **optimizer step**: everything reduced (torch's fused AdamW allocates nothing); with
  low-precision gradients the chunked torch AdamW's one-chunk temporaries;
- **a head tied to the embedding** (``StageLayout.tied``): a stage with both gathers the embedding's
  unit for the post block too; one without the post block takes its blocks' backward peaks without the
  head's gradient part (``BlockActivationTerms.backward_peak_apart``); the last stage of a pipeline
  keeps a plain copy of the weight and its ``.grad`` (``runtime.tied_weights``).

The peak is the largest of these sums over the program points: forward of each block of the
newest micro-batch, backward of each block of the oldest (gradients grow as the activations
shrink, so both ends of the layer range are points), and the optimizer step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

MIXED_PRECISION_BYTES = (2.0, 2.0, 12.0)  # weight, gradient, optimizer state per parameter
FP32_BYTES = (4.0, 4.0, 8.0)
ACCUMULATOR_BYTES = 4.0  # gradients are reduced and accumulated in fp32
# the backend's chunked torch AdamW (low-precision gradients) updates at most this many elements at once
# (runtime.kernels)
ADAMW_CHUNK_ELEMENTS = 1 << 20


# the StageMemory fields a schedule's walk reads (the stage model's breakdown carries them under these names)
SCHEDULE_MEMORY_PARTS = ("held_per_microbatch", "accumulators", "grads_at_step", "peak_step", "peak_backward_first",
                         "peak_backward_middle", "peak_backward_last")


def state_bytes_per_param(dtype: str) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter for Adam training in ``dtype``."""
    if dtype in ("float16", "bfloat16"):
        return MIXED_PRECISION_BYTES
    if dtype == "float32":
        return FP32_BYTES
    raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")


@dataclass
class BlockActivationTerms:
    """Per-candidate byte arrays of one block kind (from the memory-analysis pass)."""

    saved: np.ndarray  # A: activations kept for the backward, one micro-batch
    input: np.ndarray  # I: the block input (all a checkpointed block keeps)
    forward_peak: np.ndarray  # forward points where the block's weights are in use
    backward_peak: np.ndarray  # backward points where its weights / parameter gradients are in use
    forward_peak_weights_free: np.ndarray | None = None  # points past its last weight use (a loss)
    backward_peak_weights_free: np.ndarray | None = None  # points before its first (the loss backward)
    output: np.ndarray | None = None  # the hidden state it hands on (a pipeline boundary)
    backward_peak_apart: np.ndarray | None = None  # its backward in a stage without the post block (a tied head)


@dataclass
class StageLayout:
    """Parameter elements on one device (after tensor-parallel sharding, before ZeRO) per block."""

    pre: np.ndarray
    layer: np.ndarray
    post: np.ndarray
    num_layers: np.ndarray
    has_pre: np.ndarray
    has_post: np.ndarray
    # the backend reduces each unit (module owning parameters) on its own: the post block's unit whose backward
    # finishes it, the pre block's, and the pre unit just before that one (0: none); None: one unit per block
    post_last: np.ndarray | None = None
    pre_last: np.ndarray | None = None
    pre_previous: np.ndarray | None = None
    # elements of the weights the post block reads from the pre block (a head tied to the embedding); None: none
    tied: np.ndarray | None = None

    @property
    def total(self) -> np.ndarray:
        return self.num_layers * self.layer + self.has_pre * self.pre + self.has_post * self.post


@dataclass
class StageConfig:
    """The per-candidate choices that shape memory (arrays)."""

    dtype: str
    zero: np.ndarray
    dp: np.ndarray
    grad_accum: np.ndarray
    inflight: np.ndarray
    ckpt_layers: np.ndarray
    offload_weights: np.ndarray
    offload_grads: np.ndarray
    offload_opt: np.ndarray
    offload_acts: np.ndarray
    reduce_scatter_copies: float = 0.0  # transient input copies the library's reduce-scatter makes
    low_precision_grads: np.ndarray | bool = False  # ZeRO 0/1 keep gradients in the param dtype (plan grad_dtype)


@dataclass
class StageMemory:
    weights: np.ndarray  # static weights (shard / device part)
    grads: np.ndarray | None  # gradients held at the optimizer step (None: asked for the peak only)
    opt: np.ndarray  # master + moments on the device
    buffers: np.ndarray | None  # transient weights / gradient buffers at the peak point (None: the peak only)
    acts: np.ndarray | None  # activations at the peak point (None: the peak only)
    acts_per_microbatch: np.ndarray  # one micro-batch's saved activations
    peak: np.ndarray
    peak_forward_backward: np.ndarray | None = None  # the peak over the micro-batches' forward/backward only
    # what a schedule's walk over its actions needs (cost/schedule_memory.py): the bytes one more in-flight
    # micro-batch keeps, the gradients kept between micro-batches and after the last one, the optimizer
    # step's point and the peaks of the step's first backward, those between, and its last (at ``inflight``)
    held_per_microbatch: np.ndarray | None = None
    accumulators: np.ndarray | None = None
    grads_at_step: np.ndarray | None = None
    peak_step: np.ndarray | None = None
    peak_backward_first: np.ndarray | None = None
    peak_backward_middle: np.ndarray | None = None
    peak_backward_last: np.ndarray | None = None


def _arrays(*values) -> list[np.ndarray]:
    return [np.asarray(value, dtype=float) for value in values]


class _Gradients:
    """Gradient bytes of the backend at the points of a step, per candidate. Every quantity is linear
    in a block's parameter count, so each is a per-element coefficient computed once.

    Two paths (``runtime/zero.py``): the fp32 path (accumulators and reductions in fp32) and, for
    ZeRO 0/1 with ``low_precision_grads``, the param-dtype micro-batch buffer that is the
    accumulator itself until the last micro-batch's fp32 reduction."""

    def __init__(self, config: StageConfig, grad_bytes: float, copies: float) -> None:
        zero, dp, accum, g = np.asarray(config.zero), *_arrays(config.dp, config.grad_accum, config.offload_grads)
        # (a stage that offloads gradients keeps the fp32 path: its accumulator is split with the host)
        low = np.asarray(config.low_precision_grads, dtype=bool) & (zero <= 1) & (grad_bytes < ACCUMULATOR_BYTES) & (g == 0)
        self.accumulating = accum > 1
        self.middle = accum > 2  # micro-batches that are neither the first nor the last
        full, shard = ACCUMULATOR_BYTES, ACCUMULATOR_BYTES / dp
        scattered = (zero >= 1) & (dp > 1)
        # between micro-batches: the fp32 accumulator (ZeRO-2/3: its shard; a ``grads`` offload fraction
        # of it on the host), or the param-dtype buffer on the low-precision path
        self._accumulator = np.where(self.accumulating,
                                     np.where(low, grad_bytes, (1.0 - g) * np.where(zero >= 2, shard, full)), 0.0)
        # what a block adds once its backward of the iteration's last micro-batch is done. fp32 path, with
        # accumulation: the last micro-batch folds the accumulator's device part into what it reduces and
        # releases it: in place without gradient offload (ZeRO-0 adds nothing), else the full micro-batch
        # buffer is reduced and kept (ZeRO-0) or scattered to a shard (ZeRO-1). Low precision: ZeRO-0 keeps
        # the buffer (the mean cast back into it), ZeRO-1 trades it for the fp32 shard
        zero0 = np.where(low, np.where(self.accumulating, 0.0, grad_bytes), np.where(self.accumulating, g * full, full))
        zero1 = np.where(self.accumulating, shard - np.where(low, grad_bytes, (1.0 - g) * full), shard)
        zero23 = np.where(self.accumulating, 0.0, (1.0 - g) * shard)
        self._finished = np.select([zero == 0, zero == 1], [zero0, zero1], zero23)
        # the block whose backward runs: its micro-batch buffer (low precision: when the step's first micro-batch
        # allocates it; later it is an accumulator already)
        self._running_first = np.full(np.shape(low), grad_bytes)
        self._running_later = np.where(low, 0.0, grad_bytes)
        # on top of that while its gradients are reduced (``zero.UnitBucket.reduce``): the fp32 copy of the unit
        # (mixed precision) made while the buffer still exists; then, the buffer freed, what the reduction holds:
        # the fresh shard and the library's copies of its input when scattered, and the input itself unless it
        # is the accumulator (ZeRO 0/1 with accumulation add the copy into it) or the buffer (fp32 params)
        mixed = np.asarray(grad_bytes < ACCUMULATOR_BYTES)
        scatter = np.where(scattered, shard + copies * ACCUMULATOR_BYTES, 0.0)
        copy_kept = np.where(mixed & ~((zero <= 1) & self.accumulating), full, 0.0)
        after_cast = np.where(zero == 0, 0.0, copy_kept + scatter - grad_bytes)
        fp32_last = np.where(mixed, np.maximum(full, after_cast), np.where((zero == 1) & self.accumulating,
                                                                          np.maximum(0.0, scatter - grad_bytes), scatter))
        low_last = np.where(zero == 0, np.where(dp > 1, full, 0.0),
                            np.maximum(full, full + np.maximum(scatter, shard) - grad_bytes))
        self._reducing = np.where(low, low_last, fp32_last)
        # ZeRO 0/1 before the last micro-batch: the fp32 path casts (mixed) and adds into the accumulator
        self._reducing_other = np.where(low | ~mixed, 0.0, full)
        self._every_micro_batch = zero >= 2  # ZeRO 2/3 reduce-scatter each micro-batch, ZeRO 0/1 the last
        # the previous block's reduction input (fp32) stays until the next block's backward is done (the
        # runtime waits for a reduction one unit later, so that it overlaps that unit's backward): a
        # reduce-scatter's input, and low-precision ZeRO-0's all-reduce copy; in-place fp32 all-reduces
        # keep nothing extra
        self._pending = np.where(scattered | (low & (zero == 0) & (dp > 1)), full, 0.0)

    def accumulator(self, numel: np.ndarray) -> np.ndarray:
        return numel * self._accumulator

    def finished(self, numel: np.ndarray) -> np.ndarray:
        return numel * self._finished

    def running(self, numel: np.ndarray, first: bool) -> np.ndarray:
        return numel * (self._running_first if first else self._running_later)

    def reducing(self, numel: np.ndarray, last) -> np.ndarray:
        return numel * np.where(np.asarray(last) | self._every_micro_batch, self._reducing, self._reducing_other)

    def pending(self, numel: np.ndarray, last) -> np.ndarray:
        """While a block's backward runs: the previous block's (``numel``) reduction still in flight."""
        return numel * np.where(np.asarray(last) | self._every_micro_batch, self._pending, 0.0)


def greedy_offload(saved_sequence: list[np.ndarray], offloadable: list[bool], fraction: np.ndarray) -> np.ndarray:
    """Bytes of one layer's saved activations the backend moves to the host: in save order, a
    contiguous tensor goes if the offloaded bytes then stay within ``fraction`` of the bytes saved
    so far (``runtime.offload.ActivationOffloader``)."""
    fraction = np.asarray(fraction, dtype=float)
    saved_so_far = np.zeros_like(fraction)
    offloaded = np.zeros_like(fraction)
    for size, movable in zip(saved_sequence, offloadable):
        size = np.asarray(size, dtype=float)
        saved_so_far = saved_so_far + size
        take = movable & (size > 0) & (offloaded + size <= fraction * saved_so_far)
        offloaded = offloaded + np.where(take, size, 0.0)
    return offloaded


def acts_per_microbatch(layout: StageLayout, config: StageConfig, pre: BlockActivationTerms,
                        layer: BlockActivationTerms, post: BlockActivationTerms) -> np.ndarray:
    """One micro-batch's saved activations on a stage: pre and post blocks', each plain layer's, and a
    checkpointed layer's input."""
    n, ckpt, has_pre, has_post = _arrays(layout.num_layers, config.ckpt_layers, layout.has_pre, layout.has_post)
    return has_pre * pre.saved + ckpt * layer.input + (n - ckpt) * layer.saved + has_post * post.saved


def tied_unit(has_pre: np.ndarray, has_post: np.ndarray, tied: np.ndarray, embedding_unit: np.ndarray) -> np.ndarray:
    """Elements of the embedding's unit that a stage holding both ends of a tied head gathers for the post
    block too (the runtime's post unit needs its owner's bucket); zero elsewhere."""
    return has_pre * has_post * np.where(tied > 0, embedding_unit, 0.0)


def _held_by_this_stage(terms: BlockActivationTerms, has_post: np.ndarray) -> BlockActivationTerms:
    """``terms`` with the backward peak a stage with or without the post block holds."""
    if terms.backward_peak_apart is None:
        return terms
    return replace(terms, backward_peak=np.where(has_post > 0, terms.backward_peak, terms.backward_peak_apart))


def stage_memory(layout: StageLayout, config: StageConfig, pre: BlockActivationTerms, layer: BlockActivationTerms,
                 post: BlockActivationTerms, layer_offloaded: np.ndarray | None = None,
                 peak_only: bool = False, opt_ratios: tuple[float, ...] | None = None) -> StageMemory:
    """Device memory of one stage rank per candidate: the parts at the peak point and the peak
    (``peak_only``: the peak, the static parts and a micro-batch's activations; the rest None).
    ``opt_ratios`` (with ``peak_only``): the peak for each of these optimizer-offload ratios in place
    of ``config.offload_opt``, shape (ratios, candidates): optimizer states change only the static
    part and the step, so the program points are summed once for all of them."""
    weight_b, grad_b, _ = state_bytes_per_param(config.dtype)
    zero = np.asarray(config.zero)
    dp, w, o, a, n, ckpt, inflight = _arrays(config.dp, config.offload_weights, config.offload_opt, config.offload_acts,
                                             layout.num_layers, config.ckpt_layers, config.inflight)
    has_pre, has_post = _arrays(layout.has_pre, layout.has_post)
    p_pre, p_layer, p_post = has_pre * layout.pre, np.asarray(layout.layer, float), has_post * layout.post
    post_last = has_post * (layout.post if layout.post_last is None else np.asarray(layout.post_last, float))
    pre_last = has_pre * (layout.pre if layout.pre_last is None else np.asarray(layout.pre_last, float))
    pre_previous = has_pre * (0.0 if layout.pre_previous is None else np.asarray(layout.pre_previous, float))
    total = layout.total
    fp32 = config.dtype == "float32"
    # a head tied to the embedding: the stage holding both ends gathers the embedding's unit for the post block
    # (``runtime.stage_runtime``: the post unit needs its owner's bucket). The last stage of a pipeline keeps a
    # plain copy of the weight (``runtime.tied_weights``), whose ``.grad`` lives from the first backward to the
    # next step (the analysed layers' backward counts it), and an fp32 share of that gradient for the tied
    # group's all-reduce once the schedule is done. A stage without the post block never holds the head's
    # gradient part, which the analysed backward of the whole model carries to the embedding's (``apart``)
    tied = np.zeros_like(p_layer) if layout.tied is None else np.asarray(layout.tied, float)
    borrowed_unit = tied_unit(has_pre, has_post, tied, pre_last)
    copy = has_post * (1.0 - has_pre) * tied * weight_b
    layer, pre = (_held_by_this_stage(terms, has_post) for terms in (layer, pre))

    # ---- static states ---------------------------------------------------------------------
    persistent = (zero < 3) & (w == 0)
    weights = np.where(persistent, total * weight_b, (1.0 - w) * total * weight_b * np.where(zero >= 3, 1.0 / dp, 1.0))
    weights = weights + copy
    shard = np.where(zero >= 1, 1.0 / dp, 1.0)

    def optimizer_states(o: np.ndarray) -> np.ndarray:
        master_aliased = fp32 & ((persistent & (o == 0)) | ((zero == 3) & (o == w)))
        return (1.0 - o) * total * shard * np.where(master_aliased, 8.0, 12.0)

    opt = optimizer_states(o)

    # ---- transient weights at a block's points (ZeRO-3 gather / weights brought in) ----------
    transient = np.where(persistent, 0.0, weight_b)
    weights_at = {"pre": transient * (p_pre + np.where(n > 0, p_layer, 0.0)),
                  "layer": transient * 2.0 * p_layer, "post": transient * (p_post + borrowed_unit)}

    # ---- gradients --------------------------------------------------------------------------
    grads = _Gradients(config, grad_b, config.reduce_scatter_copies)
    accum = np.asarray(config.grad_accum, float)
    between = grads.accumulator(total)  # accumulators of every block (a previous micro-batch's backward)
    forward_grads = np.where(inflight < accum, between + copy, 0.0)
    # a block finished in the iteration's first backward keeps its accumulator (or, without
    # accumulation, its reduced gradient); in a later one it adds what the last micro-batch leaves
    if grads.accumulating.all() or not grads.accumulating.any():  # (one G for every candidate: the usual case)
        first_done = grads.accumulator if grads.accumulating.all() else grads.finished
    else:
        first_done = lambda numel: np.where(grads.accumulating, grads.accumulator(numel), grads.finished(numel))  # noqa: E731
    at_step = between + grads.finished(total) + copy * (1.0 + ACCUMULATOR_BYTES / weight_b)

    # ---- activations ------------------------------------------------------------------------
    plain = n - ckpt
    pre_acts = has_pre * pre.saved
    per_microbatch = acts_per_microbatch(layout, config, pre, layer, post)
    # activation offload: a layer keeps on the device what the greedy rule leaves; a checkpointed
    # layer saves one tensor (its input), which goes only when everything goes; the pre and post
    # blocks' units save little and the loss runs outside any unit, so they keep theirs
    offloaded = layer_offloaded if layer_offloaded is not None else a * layer.saved
    layer_kept = layer.saved - offloaded
    ckpt_kept = np.where(a >= 1.0, 0.0, layer.input)
    kept_before = lambda ckpt_count, plain_count: pre_acts + ckpt_count * ckpt_kept + plain_count * layer_kept  # noqa: E731
    # pipeline boundaries: a stage that is not the last keeps each in-flight micro-batch's output
    # until its backward; one receive (the next input, or an output gradient) is posted ahead
    boundary_output = (1.0 - has_post) * (layer.output if layer.output is not None else 0.0)
    posted_receive = np.maximum((1.0 - has_pre) * layer.input, boundary_output)
    one_held = kept_before(ckpt, plain) + has_post * post.saved + boundary_output
    before_post = kept_before(ckpt, plain)
    zeros = np.zeros_like(per_microbatch)
    post_fw_free = post.forward_peak_weights_free if post.forward_peak_weights_free is not None else zeros
    post_bw_free = post.backward_peak_weights_free if post.backward_peak_weights_free is not None else zeros
    prefetched = offloaded  # the next plain layer's offloaded activations, brought back one block ahead
    layer_weights = lambda present: np.where(present, weights_at["layer"], 0.0)  # noqa: E731
    recomputed = np.maximum(layer.forward_peak, layer.backward_peak)

    # (activations, transient weights, gradients) at each point; absent blocks contribute nothing
    forward_points = [
        (has_pre * pre.forward_peak, has_pre * weights_at["pre"], forward_grads),
        (np.where(ckpt > 0, kept_before(ckpt - 1, 0) + layer.forward_peak, zeros), layer_weights(ckpt > 0), forward_grads),
        (np.where(plain > 0, kept_before(ckpt, plain - 1) + layer.forward_peak, zeros), layer_weights(plain > 0),
         forward_grads),
        (has_post * (before_post + post.forward_peak), has_post * weights_at["post"], forward_grads),
        (has_post * (before_post + post_fw_free), zeros, forward_grads),
    ]

    # a backward's points, in order: the loss, the post block, layers last to first (both ends), checkpointed
    # layers, pre, and the moments a block's gradients are reduced. Their activations and transient weights are
    # the same in every backward of the step (computed once); the gradients differ (``backward_points``)
    backward_held = [
        (has_post * (before_post + post_bw_free), zeros),
        (has_post * (before_post + post.backward_peak), has_post * weights_at["post"]),
        (np.where(plain > 0, kept_before(ckpt, plain - 1) + np.where(plain > 1, prefetched, 0.0)
                  + layer.backward_peak, zeros), layer_weights(plain > 0)),
        (np.where(plain > 0, kept_before(ckpt, 0) + layer.backward_peak, zeros), layer_weights(plain > 0)),
        # a checkpointed layer: its forward is recomputed, then its backward runs (the first of them
        # with the other checkpointed layers' inputs alive, the last with every other gradient)
        (np.where(ckpt > 0, kept_before(ckpt - 1, 0) + recomputed, zeros), layer_weights(ckpt > 0)),
        (np.where(ckpt > 0, pre_acts + recomputed, zeros), layer_weights(ckpt > 0)),
        # the pre block's backward (its peak: the token embedding's dense gradient, charged at both of
        # these points since the analysis gives the block's peak, not its unit). The last layer's weights
        # were released and its unit's reduction is drained when the next unit finishes, and the runtime
        # prefetches nothing past pre: (a) its earlier units (positions) running, the last one's weights
        # prefetched, the last layer's reduction in flight; (b) its last unit (the token embedding)
        # running alone, the earlier units reduced (their reduction in flight)
        (has_pre * pre.backward_peak, has_pre * transient * p_pre),
        (has_pre * pre.backward_peak, has_pre * transient * pre_last),
        # the moments a block's gradients are reduced (its backward done): the post block with every
        # layer's activations still alive, a layer, and pre at the very end. The runtime finishes the
        # reduction in flight before it launches this one, so none is pending here
        (has_post * before_post, zeros),
        (np.where(plain > 0, kept_before(ckpt, plain - 1), zeros), zeros),
        (zeros, zeros),
    ]
    # a stage without the post block also holds the output it kept for this backward
    backward_held = [(acts + boundary_output, weights_here) for acts, weights_here in backward_held]

    def backward_points(base: np.ndarray, done, first: bool, last, carried=0.0) -> list[tuple]:
        """``backward_held`` with the gradients of one backward: ``base``: gradient bytes before it,
        ``done(numel)``: bytes a finished block adds, ``first``: the step's first backward, ``last`` (per
        candidate): the one whose gradients are reduced, ``carried``: a reduction of the previous backward
        still in flight when this one follows it directly (1F1B's cooldown)."""
        done_post = done(p_post)
        layers_done = lambda count: done_post + done(count * p_layer)  # noqa: E731
        running = lambda numel: grads.running(numel, first)  # noqa: E731
        reducing = lambda numel: grads.reducing(numel, last)  # noqa: E731
        # the reduction of the unit that finished just before (post's last unit before the first layer, a layer
        # before the next, the last layer before pre, pre's previous unit before its last) is still in flight
        after_post = np.where(has_post > 0, grads.pending(post_last, last), carried)
        after_layer = grads.pending(p_layer, last)
        after_first = lambda count: np.where(count > 1, after_layer, after_post)  # noqa: E731
        before_pre_last = np.where(pre_previous > 0, grads.pending(pre_previous, last), after_first(n + 1))
        earlier_copy = 0.0 if first else copy  # the tied copy's ``.grad`` from an earlier micro-batch
        gradients = [
            base + earlier_copy,
            base + running(p_post) + earlier_copy,
            base + done_post + running(p_layer) + after_post,
            base + layers_done(np.maximum(plain - 1, 0)) + running(p_layer) + after_first(plain),
            base + layers_done(plain) + running(p_layer) + after_first(plain + 1),
            base + layers_done(np.maximum(n - 1, 0)) + running(p_layer) + after_first(n),
            base + layers_done(n) + running(p_pre - pre_last) + after_first(n + 1),
            has_pre * (base + layers_done(n) + done(p_pre - pre_last) + running(pre_last) + before_pre_last),
            base + running(p_post) + reducing(p_post) + copy,
            np.where(plain > 0, base + done_post + running(p_layer) + reducing(p_layer), 0.0),
            has_pre * (base + layers_done(n) + done(p_pre - pre_last) + running(pre_last) + reducing(pre_last)),
        ]
        return [(acts, weights_here, grad) for (acts, weights_here), grad in zip(backward_held, gradients)]

    # 1F1B: the first backward runs with inflight - 1 micro-batches held and no accumulator yet; a
    # later one with every accumulator and min(inflight, grad_accum - 1) - 1 held; those between the
    # first and the last (grad_accum > 2) keep every accumulator as it is. A stage holding several
    # micro-batches ends the step with backwards back to back: the last one starts while the previous
    # one's final reduction (ZeRO 2/3) is in flight
    later_held = np.maximum(np.minimum(inflight, accum - 1.0) - 1.0, 0.0)
    keep = lambda numel: np.zeros_like(np.asarray(numel, dtype=float))  # noqa: E731
    # (a frontier's candidates share one G, so the middle backwards are usually all there or all absent)
    if grads.middle.all():
        middle = backward_points(between, keep, False, False)
    elif not grads.middle.any():
        middle = [(zeros, zeros, zeros)]
    else:
        middle = [(np.where(grads.middle, acts, 0.0), np.where(grads.middle, w, 0.0), np.where(grads.middle, g, 0.0))
                  for acts, w, g in backward_points(between, keep, False, False)]
    phases = [(inflight - 1.0, forward_points),
              (inflight - 1.0, backward_points(zeros, first_done, True, ~grads.accumulating)),
              (np.where(grads.middle, later_held, 0.0), middle),
              (np.where(grads.accumulating, later_held, inflight - 1.0),
               backward_points(np.where(grads.accumulating, between, 0.0), grads.finished, False, True,
                               carried=np.where(grads.accumulating & (inflight > 1), grads.pending(
                                   np.where(has_pre > 0, pre_last, p_layer), False), 0.0)))]
    points = []
    for held_count, phase_points in phases:
        held = held_count * one_held + posted_receive
        points += [(held + acts, weights_here, grad) for acts, weights_here, grad in phase_points]
    # fp32 gradients: torch's fused AdamW, no temporary; param-dtype gradients: the chunked torch AdamW's
    # temporaries (the denominator, and an fp32 copy of the gradient chunk)
    low_at_step = (np.asarray(config.low_precision_grads, dtype=bool) & (zero == 0) & (grad_b < ACCUMULATOR_BYTES)
                   & (np.asarray(config.offload_grads, dtype=float) == 0))

    def step_point(o: np.ndarray) -> np.ndarray:
        largest_unit_shard = np.maximum(np.maximum(p_pre, p_layer), p_post) * shard * (1.0 - o)
        return at_step + np.minimum(largest_unit_shard, ADAMW_CHUNK_ELEMENTS) * ACCUMULATOR_BYTES * 2.0 * low_at_step

    step = step_point(o)
    if peak_only:  # the tuner's question: the same largest sum, without the (points, candidates) tables
        in_steps = functools.reduce(np.maximum, (acts + weights_here + grad for acts, weights_here, grad in points))
        if opt_ratios is None:
            peak = weights + opt + np.maximum(in_steps, step)
        else:
            ratios = [np.full(np.shape(o), float(ratio)) for ratio in opt_ratios]
            peak = np.stack([np.broadcast_to(weights + optimizer_states(r) + np.maximum(in_steps, step_point(r)),
                                             np.shape(in_steps)) for r in ratios])
        return StageMemory(weights=weights, grads=None, opt=opt, buffers=None, acts=None,
                           acts_per_microbatch=per_microbatch, peak=peak)
    shape = np.broadcast_shapes(*(np.shape(part) for point in points for part in point))
    # one (points, candidates) array per part; the peak point's parts are read off at its index
    acts_by_point, weights_by_point, grads_by_point = (
        np.stack([np.broadcast_to(point[part], shape) for point in points]) for part in range(3))
    sums = acts_by_point + weights_by_point + grads_by_point
    bounds = np.cumsum([0] + [len(phase_points) for _, phase_points in phases])
    by_phase = [weights + opt + sums[start:end].max(axis=0) for start, end in zip(bounds[:-1], bounds[1:])]
    largest = np.expand_dims(np.argmax(sums, axis=0), 0)
    acts_at_peak, weights_at_peak, grads_at_peak = (
        np.take_along_axis(parts, largest, axis=0)[0] for parts in (acts_by_point, weights_by_point, grads_by_point))
    in_steps = np.take_along_axis(sums, largest, axis=0)[0]
    peak = weights + opt + np.maximum(in_steps, step)
    at_step_wins = step > in_steps
    return StageMemory(
        weights=weights, grads=np.where(at_step_wins, at_step, grads_at_peak), opt=opt,
        buffers=np.where(at_step_wins, step - at_step, weights_at_peak),
        acts=np.where(at_step_wins, 0.0, acts_at_peak), acts_per_microbatch=per_microbatch, peak=peak,
        peak_forward_backward=weights + opt + in_steps, held_per_microbatch=one_held, accumulators=between,
        grads_at_step=at_step, peak_step=weights + opt + step, peak_backward_first=by_phase[1],
        peak_backward_middle=by_phase[2], peak_backward_last=by_phase[3])
