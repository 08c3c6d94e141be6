"""Peak device memory of live tensors over a region of a program: what the cost model's peak is checked against.

``DevicePeakMemory(device)`` is a context manager; enter it before the model is built, call
``reset_peak()`` where the measured window starts and read ``peak_bytes`` where it ends.

- CUDA: the caching allocator's statistics (``torch.cuda.max_memory_allocated``).
- CPU (no allocator statistics): a ``TorchDispatchMode`` sees the tensors every op produces or
  touches; each distinct storage is followed with a weak reference until it dies, and its size is
  re-read when the runtime resizes it in place (flat buffers free and re-materialise their storage
  with ``UntypedStorage.resize_``, which is wrapped for the duration). The peak is sampled after
  every op and every resize. Storages allocated by ``runtime.streams.host_empty`` are host memory
  (offloaded states and activations) and are not counted: on CPU host and device share the RAM.
  Custom ops written in Python (``mist_compiler.ops``) run their body under the mode, so their
  own temporaries (a chunk of logits) count as a CUDA allocator would see them.

Only storages of the given device type count; tensors that existed before the context was
entered are counted from the first op that touches them (enter early). FakeTensors never count:
inductor compiling a unit inside the window traces it on fake tensors its caches keep alive, which
made a compiled run's first steps look gigabytes larger than the program ever holds.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..runtime.streams import allocating_host_memory


class _StorageTracker(TorchDispatchMode):
    """Live device bytes by storage, with the running peak (CPU path of ``DevicePeakMemory``)."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.live: dict[int, tuple[weakref.ref, int]] = {}  # StorageImpl address -> (ref, counted bytes)
        self.host: set[int] = set()
        self.current = 0
        self.peak = 0
        self._original_resize: Any = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        definition = _maybe_get_opdef(func) if isinstance(func, torch._ops.OpOverload) else None
        if definition is not None:  # a custom op written in Python (``mist_compiler.ops``): run its body
            with self:  # with the mode on again, so that the temporaries it allocates count too
                out = definition._init_fn(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        host = allocating_host_memory()
        for value in tree_flatten((out, args, kwargs))[0]:
            if isinstance(value, torch.Tensor):
                self._see(value, host)
        self.peak = max(self.peak, self.current)
        return out

    def _see(self, tensor: torch.Tensor, host: bool = False) -> None:
        if tensor.device.type != self.device_type or tensor.is_sparse or is_fake(tensor):
            return  # a compiler's FakeTensors (inductor compiling a unit inside the window) hold no memory
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            return
        key = storage._cdata
        if key in self.live or key in self.host:
            return
        if host:
            self.host.add(key)
            weakref.finalize(storage, self.host.discard, key)
            return
        nbytes = storage.nbytes()
        self.live[key] = (weakref.ref(storage, lambda ref, key=key: self._forget(key, ref)), nbytes)
        self.current += nbytes

    def _forget(self, key: int, ref: weakref.ref) -> None:
        entry = self.live.get(key)
        if entry is not None and entry[0] is ref:
            del self.live[key]
            self.current -= entry[1]

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        entry = self.live.get(key)
        if entry is None:
            return
        nbytes = storage.nbytes()
        self.live[key] = (entry[0], nbytes)
        self.current += nbytes - entry[1]
        self.peak = max(self.peak, self.current)

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage, size):
            result = original(storage, size)
            tracker._resized(storage)
            return result

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc_info):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc_info)


class DevicePeakMemory:
    """Peak bytes of live tensors on ``device`` since entry or the last ``reset_peak()``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"DevicePeakMemory: device must be cpu or cuda, got {self.device}")
        self._tracker = _StorageTracker("cpu") if self.device.type == "cpu" else None

    def __enter__(self) -> "DevicePeakMemory":
        if self._tracker is not None:
            self._tracker.__enter__()
        else:
            torch.cuda.init()  # a fresh process's allocator has no device until CUDA is initialised
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc_info)

    def track(self, *tensors: torch.Tensor) -> None:
        """Count tensors that existed before entry (CPU; on CUDA the allocator already knows them)."""
        if self._tracker is not None:
            for tensor in tensors:
                self._tracker._see(tensor)
            self._tracker.peak = max(self._tracker.peak, self._tracker.current)

    def reset_peak(self) -> None:
        if self._tracker is not None:
            self._tracker.peak = self._tracker.current
        else:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def current_bytes(self) -> int:
        if self._tracker is not None:
            return self._tracker.current
        return torch.cuda.memory_allocated(self.device)

    @property
    def peak_bytes(self) -> int:
        if self._tracker is not None:
            return self._tracker.peak
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)
