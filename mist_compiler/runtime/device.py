"""Devices, dtypes and the process group of one rank.

Each rank runs on its own device: ``LOCAL_RANK``'s GPU under torchrun (or the device the caller
names), made the *current* CUDA device before anything touches CUDA, so every kernel launched
without an explicit device (Triton launches use the current device), every collective's staging
(``gather_object`` puts objects on the current device for NCCL) and every stream the runtime creates
lands on that GPU, not on GPU 0. A process group this module starts on GPUs passes ``device_id``
(NCCL binds its communicator to the rank's GPU and creates it eagerly); one the launcher already
started is used as it is, after the same ``set_device``. On a machine without CUDA the same calls
pick the CPU and gloo, so there is one code path.

Batched point-to-point transfers on NCCL run on the world communicator, and the first operation on
a communicator must involve all its ranks (``batch_isend_irecv``'s documentation):
:func:`warm_up_world` runs one tiny all-reduce on every rank before the pipeline starts.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


class DeviceError(RuntimeError):
    """The rank's device cannot be chosen (e.g. LOCAL_RANK beyond the visible GPUs)."""


def local_rank() -> int:
    """This process's index on its node (torchrun's ``LOCAL_RANK``; 0 outside a launcher)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def select_device(requested: torch.device | str | None = None) -> torch.device:
    """The rank's device, made current: ``requested``, else ``cuda:LOCAL_RANK`` when CUDA is
    available, else the CPU."""
    if requested is not None:
        device = torch.device(requested)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", local_rank())
    elif torch.cuda.is_available():
        device = torch.device("cuda", local_rank())
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index >= count:
            raise DeviceError(f"rank's device {device} does not exist: {count} GPU(s) visible "
                              f"(LOCAL_RANK={local_rank()}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        torch.cuda.set_device(device)
    return device


def init_process_group(timeout_s: float, device: torch.device) -> None:
    """Use the launched process group, or start one: NCCL bound to ``device`` on GPUs, gloo on CPU,
    a one-rank gloo group for single-process use."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if device.type == "cuda":
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
        else:
            dist.init_process_group("gloo", timeout=timeout)
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def warm_up_world(device: torch.device) -> None:
    """One all-reduce on the world group, on every rank (see the module docstring). Collective."""
    if dist.get_world_size() > 1 and dist.get_backend() == "nccl":
        dist.all_reduce(torch.zeros(1, device=device))

