"""Devices, dtypes and the process group of one rank.

Moved out of ``engine.py``; see the functions.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _ensure_process_group(timeout_s: float) -> None:
    """Use the launched process group, or start a one-rank one for single-process use."""
    if dist.is_initialized():
        return
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=timeout_s))
