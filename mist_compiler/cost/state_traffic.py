"""What the backend does to gradient and optimizer state besides the captured graphs, priced per
candidate: the passes over gradient buffers (zeroing, scaling, autograd's in-place accumulation, the
fp32 accumulator and its offloaded part's copies, low-precision casts) and the optimizer step's device
and host halves (``runtime/zero.py``, ``runtime/flat_buffer.py``, ``runtime/offload.py``,
``runtime/optimizer.py``). The stage model adds these to the phases the graphs' costs make."""
from __future__ import annotations

import numpy as np

from .memory import ACCUMULATOR_BYTES


def optimizer_phase_s(device_and_copies: np.ndarray, host_step: np.ndarray, step_out: np.ndarray,
                      step_in: np.ndarray, units: np.ndarray) -> np.ndarray:
    """The optimizer step as ``runtime.optimizer.FlatAdamW`` runs it: the device parts' update overlaps
    the offloaded parts' copies (``device_and_copies``) and the host threads' AdamW, which starts when the
    first unit's gradients have arrived and ends with the last unit's weights going back (the units'
    copies pipeline with the host updates)."""
    units = np.maximum(np.asarray(units, dtype=float), 1.0)
    host_chain = np.where(host_step > 0, host_step + (step_out + step_in) / units, 0.0)
    return np.maximum(device_and_copies, host_chain)


# Every micro-batch, autograd adds each parameter's new gradient into the ``.grad`` view the runtime
# bound into its flat buffer (``runtime.flat_buffer.bind_grads``): two reads and a write of the gradients,
# on top of the backward the captured graph holds (which ends at the gradients it returns).
AUTOGRAD_ACCUMULATE_PASSES = 3.0


def grad_buffer_bytes_moved(grad_bytes: np.ndarray, dp: np.ndarray) -> np.ndarray:
    """Bytes the backend moves over a micro-batch's gradient buffers besides the backward itself:
    zeroing them before the backward (one write), and with data parallelism scaling them by
    ``1/dp`` in place before the reduction (a read and a write)."""
    return grad_bytes * (1.0 + np.where(np.asarray(dp) > 1, 2.0, 0.0))


def low_precision_bytes_moved(grad_bytes: np.ndarray, stage_params: np.ndarray, zero: np.ndarray,
                              dp: np.ndarray) -> np.ndarray:
    """Per iteration, low-precision gradients (ZeRO 0/1, ``runtime/zero.py``): the buffer zeroed once,
    cast to an fp32 copy for the reduction (a read and an fp32 write), and under ZeRO-0 with data
    parallelism the mean cast back (an fp32 read and a write). Autograd's in-place accumulation of the
    micro-batches is priced with the backward (``AUTOGRAD_ACCUMULATE_PASSES``), as on the fp32 path."""
    dp = np.asarray(dp, dtype=float)
    cast = grad_bytes + 4.0 * stage_params
    back = np.where((np.asarray(zero) == 0) & (dp > 1), cast, 0.0)
    return grad_bytes + cast + back


def accumulation_bytes_moved(stage_params: np.ndarray, zero: np.ndarray, dp: np.ndarray,
                             grad_accum: np.ndarray) -> np.ndarray:
    """Bytes of adding the micro-batches' gradients into the fp32 accumulator, per iteration:
    every micro-batch after the first reads the accumulator and its gradients and writes the sum
    (levels 0-1 hold the whole stage's gradients, levels 2-3 the rank's reduced shard)."""
    zero, dp = np.asarray(zero), np.asarray(dp, dtype=float)
    accumulator_bytes = 4.0 * stage_params * np.where(zero >= 2, 1.0 / dp, 1.0)
    return 3.0 * accumulator_bytes * np.maximum(np.asarray(grad_accum, dtype=float) - 1.0, 0.0)


def offloaded_grad_bytes(stage_params: np.ndarray, offload_grads: np.ndarray, zero: np.ndarray,
                         dp: np.ndarray, grad_accum: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(device -> host, host -> device) bytes per micro-batch, on average, of the fp32 accumulator's
    offloaded fraction (``runtime/offload.py``: on a GPU an accumulating write brings the host slice to
    the device, adds there and copies the sum back). ZeRO 2-3 write every micro-batch's reduced shard
    into it, adding from the second on; ZeRO 0-1 write every micro-batch but the last, which folds the
    host part back into the buffer it reduces, so it brings it back once as well."""
    zero, dp = np.asarray(zero), np.asarray(dp, dtype=float)
    accum = np.maximum(np.asarray(grad_accum, dtype=float), 1.0)
    share = np.where(zero >= 2, 1.0 / dp, 1.0)
    host = np.asarray(offload_grads, dtype=float) * ACCUMULATOR_BYTES * stage_params * share
    later = (accum - 1.0) / accum  # the share of micro-batches that find an accumulator there
    return host * np.where(zero >= 2, 1.0, later), host * later


def step_grads_to_device(offload_grads: np.ndarray, offload_opt: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """The fraction of the optimizer's shard whose gradients come back from the host before the step:
    under ZeRO 2-3 the accumulator's offloaded tail stays on the host, and the part of it the device
    optimizer updates is copied back (``runtime/optimizer.py``); under ZeRO 0-1 the last micro-batch
    folded it into the buffer it reduced. (The host optimizer's part is priced as sent to the host
    whether or not its gradients are there already: the tuner prunes on more offload never being
    faster.)"""
    g, o = np.asarray(offload_grads, dtype=float), np.asarray(offload_opt, dtype=float)
    return np.where(np.asarray(zero) >= 2, np.maximum(g - o, 0.0), 0.0)
