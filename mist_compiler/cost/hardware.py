"""Hardware profiles: the validated schema the cost model reads (YAML on disk).

A profile says how fast one kind of device computes, moves memory, talks to its peers and to
the host, and how those channels slow each other when they run together. Shipped profiles live
in ``cost/profiles/NAME.yaml``; ``mistc profile`` measures a new one. Every field is checked on
load and an error names the field.

Units: bytes and seconds throughout, except the human-facing YAML keys that say otherwise
(``_gb`` = 1e9 bytes, ``_gbps`` = 1e9 bytes/s, ``_tflops`` = 1e12 FLOP/s).

Meaning of the fields the cost model reads:

* ``efficiency[op_class]`` (``matmul``, ``attention``, ``elementwise``, ``reduction``, ``default``
  for the rest; measured profiles add ``norm`` and ``softmax``): the fraction of the roofline an
  op of that class achieves. For the compute-bound classes (matmul, attention) it scales
  ``peak_flops[dtype]``; for the memory-bound ones it scales ``memory_bandwidth`` (the achieved
  device copy rate). ``cost/op_time.py`` applies it.
* ``collectives['NxG']``: alpha-beta fits per group shape; ``cost.comm`` derives unlisted shapes.
* ``op_overhead_s`` (optional, default 0): fixed seconds per op on top of its roofline time
  (eager dispatch on CPU, kernel launch on GPU); matters for small models.
* ``reduce_scatter_copies`` (optional, default 0): transient copies of its whole input that the
  communication library's reduce-scatter allocates while it runs (gloo: 1, measured by
  ``mistc profile``; NCCL: 0); the memory model adds them to the gradient reduction.
* ``optimizer_gparams_per_s`` (optional): AdamW update rate, 1e9 fp32 parameters/s, of the
  backend's flat-shard optimizer kernel on the device (``mistc profile`` times it). Absent: the fused
  kernel's ``FUSED_ADAM_BYTES_PER_PARAM`` of traffic at ``memory_bandwidth`` (the datasheet profiles).
  On a CPU the kernel is torch's several-pass AdamW and runs at about a third of that.
* ``host_optimizer_gparams_per_s`` (optional): the same for optimizer states offloaded to the host,
  as the backend updates them there: split over its host worker threads (a rank's share of the
  cores). Absent: ``DEFAULT_HOST_ADAM_PARAMS_PER_S``.
* ``stream_gbps`` (optional): the memory rate of one pass over buffers far larger than the caches,
  as the once-a-step passes over the model state run (zeroing the gradient buffers, adding the
  micro-batches' gradients into the accumulator). Absent: an elementwise op's rate
  (``memory_bandwidth_gbps`` x ``efficiency.elementwise``). A GPU's copy rate is measured on such
  buffers already; a CPU's is measured on one its cache keeps (like a layer's activations) and is
  about 3x the streaming rate on the machine that wrote this.
* ``compiled_pointwise_ns`` (optional): per pointwise op whose math a compiled kernel does not hide
  under its memory pass (``gelu``, ``gelu_backward``, ``silu``, ``silu_backward``: erf and exp on a
  CPU's vector units), nanoseconds per element beyond that pass (``cost.compiled`` adds them to the
  fused region holding the op). Absent or 0: the math hides (a GPU's kernels are memory-bound).
* ``slowdown['A|B']``: factor by which channel A runs slower while channel B is active
  (channels ``compute``, ``collective``, ``h2d``, ``d2h``); missing pairs are 1. ``cost.overlap``
  simulates a phase with them.
* ``memory_headroom_gb`` (optional, default 0): the part of ``device_memory_gb`` a plan must leave
  free for what the memory model does not count: the CUDA context and kernel images, NCCL's
  communicator buffers, cuBLAS/cuDNN workspaces and the caching allocator's fragmentation
  (reserved minus allocated). The tuner and ``mistc analyze`` hold a stage's predicted peak
  (allocated bytes) to ``device_memory - memory_headroom`` (``usable_memory``), or to the
  ``--memory-limit`` given on the command line (:func:`with_memory_limit`). Shipped GPU profiles
  carry :func:`default_memory_headroom` of their card; ``mistc profile`` measures the context.
* ``matmul_shape_model`` (optional): GEMMs do not all run at one rate. An M x N x K GEMM with
  intensity ``I = MNK / (MK + KN + MN)`` (FLOPs per element moved, halved) runs at
  ``peak * peak_efficiency * I / (I + half_intensity)`` FLOP/s, at least as long as its bytes take at
  ``memory_bandwidth``, plus ``tail_s`` (launch, the last partial wave of tiles). Absent: every
  matmul runs at ``efficiency['matmul']``. ``mistc profile`` fits it to the GEMMs it times and keeps
  those in ``matmul_shapes`` (``[m, n, k, achieved fraction of peak]``, for reference and refits).
* ``sustained_compute`` (optional, default 1): the fraction of its measured GEMM and attention rates a
  device holds through a training run. Short benchmarks run at the boost clock; back-to-back GEMMs
  drive a GPU to its power limit, where the clock settles lower. ``cost/op_time.py`` scales the
  compute-bound classes by it (the peak itself, which MFU is measured against, stays the datasheet's);
  ``mistc profile`` measures it on a GPU (the GEMM rate after seconds of back-to-back GEMMs against
  the first ones).
* ``mfu_ceiling`` (optional): the model-FLOPs utilisation the best published training runs on this
  hardware reach; a predicted MFU above it is flagged (``tune`` adds a warning) because a cost model
  that optimistic for a shape will pick plans that disappoint.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..ir.vocabulary import TRAINING_DTYPES

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")
CHANNELS = ("compute", "collective", "h2d", "d2h")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "broadcast", "all_to_all")
# A fused AdamW step (the backend's flat-shard kernel) reads master weight, gradient and both moments
# and writes weight and moments back with the low-precision copy: 28 bytes per fp32 parameter.
FUSED_ADAM_BYTES_PER_PARAM = 28.0
DEFAULT_HOST_ADAM_PARAMS_PER_S = 1.0e9  # multi-threaded CPU Adam (DeepSpeed CPU-Adam order)
# What a GPU keeps outside the caching allocator's count of allocated bytes (see the docstring):
CUDA_CONTEXT_BYTES = 0.5e9  # context + kernel images of torch, NCCL, cuBLAS, Triton (CUDA 12, lazy loading)
WORKSPACE_BYTES = 0.25e9  # cuBLAS/cuBLASLt (32 MiB per handle and stream on Hopper) and cuDNN workspaces
NCCL_BYTES = 0.5e9  # NCCL communicator buffers of a rank's few groups (4 MiB per channel and peer)
FRAGMENTATION = 0.05  # reserved / allocated - 1 of the caching allocator in training (Mist's L4 runs: 4-8%)


OPTIONAL_KEYS = {"description", "collective_factor", "slowdown", "op_overhead_s", "reduce_scatter_copies",
                 "optimizer_gparams_per_s", "host_optimizer_gparams_per_s", "memory_headroom_gb",
                 "matmul_shape_model", "matmul_shapes", "mfu_ceiling", "sustained_compute", "stream_gbps",
                 "compiled_pointwise_ns"}


def default_memory_headroom(device_memory: float, context: float = CUDA_CONTEXT_BYTES) -> float:
    """Bytes of a GPU's ``device_memory`` a plan must leave free: context (measured, or the typical
    value), workspaces, NCCL buffers, and the fragmentation share of the rest."""
    fixed = context + WORKSPACE_BYTES + NCCL_BYTES
    return fixed + FRAGMENTATION * max(device_memory - fixed, 0.0)


def parse_memory(text: str) -> float:
    """``"70"`` / ``"70GB"`` (1e9 bytes), ``"64GiB"``, ``"70000MB"``, ``"1.5TB"`` -> bytes."""
    units = {"tib": 2 ** 40, "gib": 2 ** 30, "mib": 2 ** 20, "tb": 1e12, "gb": 1e9, "mb": 1e6, "": 1e9}
    value = str(text).strip().lower()
    for unit in sorted(units, key=len, reverse=True):
        if value.endswith(unit):
            number = value[:len(value) - len(unit)].strip()
            try:
                amount = float(number)
            except ValueError:
                break
            if amount > 0:
                return amount * units[unit]
            break
    raise ProfileError(f"memory limit: expected a positive size such as 70, 70GB, 64GiB or 70000MB, got {text!r}")


class ProfileError(ValueError):
    """A hardware profile that is malformed; the message names the field."""


def _require(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise ProfileError(f"hardware profile field {where}: {message}")


def _positive(value: Any, where: str) -> float:
    _require(_number(value), where, f"expected a number, got {value!r}")
    _require(value > 0 and value != float("inf"), where, f"must be positive, got {value}")
    return float(value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _keys(data: Any, where: str, required: set[str], optional: set[str] = frozenset()) -> None:
    _require(isinstance(data, dict), where, f"expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - required - set(optional))
    _require(not unknown, where, f"unknown key(s) {unknown}; allowed: {sorted(required | set(optional))}")
    missing = sorted(required - set(data))
    _require(not missing, where, f"missing key(s) {missing}")


@dataclass(frozen=True)
class LinkFit:
    """Alpha-beta fit of one group shape: time = bytes / bandwidth * (n-1)/n * factor + latency."""

    bandwidth: float  # bytes/s
    latency: float  # s


@dataclass(frozen=True)
class MatmulShapeModel:
    """Achieved GEMM rate by shape (see the module docstring): efficiency saturating in intensity, plus a tail."""

    peak_efficiency: float  # fraction of peak FLOP/s a large, square GEMM approaches
    half_intensity: float  # intensity at which half of peak_efficiency is reached
    tail_s: float  # fixed seconds per GEMM

    def efficiency(self, intensity):
        return self.peak_efficiency * intensity / (intensity + self.half_intensity)


def _matmul_model(data: Any) -> MatmulShapeModel | None:
    if data is None:
        return None
    where = "matmul_shape_model"
    _keys(data, where, {"peak_efficiency", "half_intensity", "tail_s"})
    peak = data["peak_efficiency"]
    _require(_number(peak) and 0 < peak <= 1, f"{where}.peak_efficiency", f"must be in (0, 1], got {peak!r}")
    for key in ("half_intensity", "tail_s"):
        value = data[key]
        _require(_number(value) and 0 <= value < float("inf"), f"{where}.{key}", f"must be >= 0, got {value!r}")
    _require(data["tail_s"] < 1.0, f"{where}.tail_s", f"seconds per GEMM, < 1, got {data['tail_s']!r}")
    return MatmulShapeModel(float(peak), float(data["half_intensity"]), float(data["tail_s"]))


def _matmul_points(data: Any) -> tuple[tuple[int, int, int, float], ...]:
    if data is None:
        return ()
    _require(isinstance(data, list), "matmul_shapes", "expected a list of [m, n, k, efficiency]")
    points = []
    for index, point in enumerate(data):
        where = f"matmul_shapes[{index}]"
        _require(isinstance(point, (list, tuple)) and len(point) == 4, where, f"expected [m, n, k, efficiency], got {point!r}")
        _require(all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in point[:3]), where,
                 f"m, n, k must be positive integers, got {point[:3]!r}")
        _require(_number(point[3]) and 0 < point[3] <= 1.5, where, f"efficiency must be in (0, 1.5], got {point[3]!r}")
        points.append((int(point[0]), int(point[1]), int(point[2]), float(point[3])))
    return tuple(points)


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind and its node: rates, links, copies, interference (see the module docstring)."""

    name: str
    device_memory: float  # bytes usable by the framework on one device
    gpus_per_node: int  # devices per node this profile describes (upper bound for group shapes)
    peak_flops: dict[str, float]  # FLOP/s per dtype (dense)
    efficiency: dict[str, float]  # achieved fraction of peak per op class ("matmul", "attention", ...)
    memory_bandwidth: float  # bytes/s, achieved device memory copy rate
    links: dict[tuple[int, int], LinkFit]  # (nodes, gpus_per_node) -> fit
    collective_factor: dict[str, float]  # multiplier per collective relative to all-gather
    h2d_bandwidth: float  # bytes/s, pinned host-to-device
    d2h_bandwidth: float  # bytes/s, pinned device-to-host
    # slowdown[(a, b)] = factor by which channel a runs slower while channel b is active
    slowdown: dict[tuple[str, str], float] = field(default_factory=dict)
    description: str = ""
    op_overhead: float = 0.0  # s, fixed cost of launching one op (framework dispatch / kernel launch)
    reduce_scatter_copies: float = 0.0  # transient copies of its input a reduce-scatter allocates
    optimizer_params_per_s: float = 0.0  # measured AdamW rate on the device; 0: from memory_bandwidth
    host_optimizer_params_per_s: float = 0.0  # measured AdamW rate on the host; 0: the default
    stream_bandwidth: float = 0.0  # bytes/s of one pass over buffers beyond the caches; 0: the elementwise rate
    compiled_pointwise_ns: dict[str, float] = field(default_factory=dict)  # op -> ns per element beyond a memory pass
    memory_headroom: float = 0.0  # bytes of device_memory a plan leaves free (context, NCCL, workspaces, fragmentation)
    memory_limit: float = 0.0  # bytes a plan may use when set on the command line (replaces the two above)
    matmul_model: MatmulShapeModel | None = None  # GEMM rate by shape; None: efficiency['matmul'] for all
    matmul_points: tuple[tuple[int, int, int, float], ...] = ()  # measured (m, n, k, efficiency), for reference
    mfu_ceiling: float | None = None  # best MFU published runs on this hardware reach (sanity check)
    sustained_compute: float = 1.0  # fraction of the measured GEMM/attention rates held through a training run
    # values derived from the fields above, memoised by their users (e.g. cost.comm's per-shape links);
    # not an init field, so dataclasses.replace starts a fresh one
    derived: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def usable_memory(self) -> float:
        """Bytes a stage's predicted peak may reach: ``--memory-limit``, else device memory minus headroom."""
        return self.memory_limit or max(self.device_memory - self.memory_headroom, 0.0)

    @property
    def device_adam_params_per_s(self) -> float:
        """AdamW parameters per second on the device: measured, else the fused kernel's roofline."""
        return self.optimizer_params_per_s or self.memory_bandwidth / FUSED_ADAM_BYTES_PER_PARAM

    @property
    def state_pass_bandwidth(self) -> float:
        """Bytes/s of a once-a-step pass over the model state (gradient buffers, accumulators):
        measured, else an elementwise op's rate."""
        return self.stream_bandwidth or self.memory_bandwidth * self.efficiency_of("elementwise")

    @property
    def host_adam_params_per_s(self) -> float:
        """AdamW parameters per second for states offloaded to the host."""
        return self.host_optimizer_params_per_s or DEFAULT_HOST_ADAM_PARAMS_PER_S

    def efficiency_of(self, op_class: str) -> float:
        """Efficiency of an op class; a class the profile does not list gets ``default`` (else 1)."""
        return self.efficiency.get(op_class, self.efficiency.get("default", 1.0))

    @classmethod
    def from_dict(cls, data: Any, source: str = "<profile>") -> "HardwareProfile":
        top = {"name", "device_memory_gb", "gpus_per_node", "peak_tflops", "efficiency",
               "memory_bandwidth_gbps", "collectives", "h2d_gbps", "d2h_gbps"}
        _keys(data, source, top, OPTIONAL_KEYS)
        _require(isinstance(data["name"], str) and data["name"].strip() != "", "name", f"expected a non-empty string, got {data['name']!r}")
        _require(isinstance(data.get("description", ""), str), "description", "expected a string")
        gpus_per_node = data["gpus_per_node"]
        _require(isinstance(gpus_per_node, int) and not isinstance(gpus_per_node, bool) and gpus_per_node > 0,
                 "gpus_per_node", f"expected a positive integer, got {gpus_per_node!r}")
        peak = data["peak_tflops"]
        _keys(peak, "peak_tflops", set(), set(TRAINING_DTYPES))
        _require(bool(peak), "peak_tflops", f"give at least one of {list(TRAINING_DTYPES)}")
        efficiency = data["efficiency"]
        _require(isinstance(efficiency, dict) and efficiency, "efficiency", "expected a non-empty mapping op class -> fraction")
        for op_class, value in efficiency.items():
            _require(isinstance(op_class, str), f"efficiency.{op_class}", "op class names are strings")
            _require(_number(value) and 0 < value <= 1, f"efficiency.{op_class}", f"must be in (0, 1], got {value!r}")
        links = {}
        _require(isinstance(data["collectives"], dict) and data["collectives"], "collectives", "expected a non-empty mapping 'NxM' -> {bandwidth_gbps, latency_s}")
        for shape, fit in data["collectives"].items():
            where = f"collectives.{shape}"
            parts = str(shape).lower().split("x")
            _require(len(parts) == 2 and all(p.isdigit() and int(p) > 0 for p in parts), where, "group shape must be 'NODESxGPUS', e.g. '1x8'")
            shape_key = (int(parts[0]), int(parts[1]))
            _require(shape_key != (1, 1), where, "a one-device group has no collective cost; list shapes of 2+ devices")
            _require(shape_key[1] <= gpus_per_node, where, f"{shape_key[1]} gpus per node exceeds gpus_per_node={gpus_per_node}")
            _require(shape_key not in links, where, "group shape listed twice")
            _keys(fit, where, {"bandwidth_gbps", "latency_s"})
            latency = fit["latency_s"]
            _require(_number(latency) and 0 <= latency < float("inf"), f"{where}.latency_s", f"must be >= 0, got {latency!r}")
            links[shape_key] = LinkFit(_positive(fit["bandwidth_gbps"], f"{where}.bandwidth_gbps") * 1e9, float(latency))
        factors = {"all_gather": 1.0, "reduce_scatter": 1.1, "all_reduce": 2.1, "p2p": 1.0, "broadcast": 1.0, "all_to_all": 1.0}
        collective_factor = data.get("collective_factor") or {}
        _require(isinstance(collective_factor, dict), "collective_factor", "expected a mapping collective -> factor")
        for name, value in collective_factor.items():
            _require(name in COLLECTIVES, f"collective_factor.{name}", f"unknown collective; known: {list(COLLECTIVES)}")
            factors[name] = _positive(value, f"collective_factor.{name}")
        slowdown = {}
        slowdown_data = data.get("slowdown") or {}
        _require(isinstance(slowdown_data, dict), "slowdown", "expected a mapping 'A|B' -> factor")
        for pair, value in slowdown_data.items():
            where = f"slowdown.{pair}"
            names = str(pair).split("|")
            _require(len(names) == 2 and all(n in CHANNELS for n in names) and names[0] != names[1], where,
                     f"key must be 'A|B' with two different channels from {list(CHANNELS)}")
            _require(_number(value) and 1.0 <= value < float("inf"), where, f"a slowdown factor is >= 1, got {value!r}")
            slowdown[(names[0], names[1])] = float(value)
        op_overhead = data.get("op_overhead_s", 0.0)
        _require(_number(op_overhead) and 0 <= op_overhead < 1.0, "op_overhead_s",
                 f"seconds per op, >= 0 and < 1, got {op_overhead!r}")
        copies = data.get("reduce_scatter_copies", 0.0)
        _require(_number(copies) and 0 <= copies <= 8, "reduce_scatter_copies",
                 f"copies of the input, between 0 and 8, got {copies!r}")
        rates = {key: _positive(data[key], key) * 1e9 if key in data else 0.0
                 for key in ("optimizer_gparams_per_s", "host_optimizer_gparams_per_s", "stream_gbps")}
        device_memory_gb = _positive(data["device_memory_gb"], "device_memory_gb")
        headroom = data.get("memory_headroom_gb", 0.0)
        _require(_number(headroom) and 0 <= headroom < device_memory_gb, "memory_headroom_gb",
                 f"GB kept free, >= 0 and below device_memory_gb={device_memory_gb}, got {headroom!r}")
        sustained = data.get("sustained_compute", 1.0)
        _require(_number(sustained) and 0 < sustained <= 1, "sustained_compute", f"a fraction in (0, 1], got {sustained!r}")
        pointwise = data.get("compiled_pointwise_ns", {})
        _require(isinstance(pointwise, dict) and all(isinstance(op, str) and _number(ns) and 0 <= ns < 1e6
                                                     for op, ns in pointwise.items()), "compiled_pointwise_ns",
                 f"a mapping of op name to nanoseconds per element (>= 0), got {pointwise!r}")
        ceiling = data.get("mfu_ceiling")
        _require(ceiling is None or (_number(ceiling) and 0 < ceiling <= 1), "mfu_ceiling",
                 f"a fraction in (0, 1], got {ceiling!r}")
        return cls(
            memory_headroom=float(headroom) * 1e9,
            matmul_model=_matmul_model(data.get("matmul_shape_model")),
            matmul_points=_matmul_points(data.get("matmul_shapes")),
            mfu_ceiling=None if ceiling is None else float(ceiling),
            sustained_compute=float(sustained),
            optimizer_params_per_s=rates["optimizer_gparams_per_s"],
            host_optimizer_params_per_s=rates["host_optimizer_gparams_per_s"],
            stream_bandwidth=rates["stream_gbps"],
            compiled_pointwise_ns={op: float(ns) for op, ns in pointwise.items()},
            op_overhead=float(op_overhead),
            reduce_scatter_copies=float(copies),
            name=data["name"],
            device_memory=device_memory_gb * 1e9,
            gpus_per_node=gpus_per_node,
            peak_flops={dtype: _positive(v, f"peak_tflops.{dtype}") * 1e12 for dtype, v in peak.items()},
            efficiency={k: float(v) for k, v in efficiency.items()},
            memory_bandwidth=_positive(data["memory_bandwidth_gbps"], "memory_bandwidth_gbps") * 1e9,
            links=links,
            collective_factor=factors,
            h2d_bandwidth=_positive(data["h2d_gbps"], "h2d_gbps") * 1e9,
            d2h_bandwidth=_positive(data["d2h_gbps"], "d2h_gbps") * 1e9,
            slowdown=slowdown,
            description=str(data.get("description", "")),
        )

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "device_memory_gb": self.device_memory / 1e9,
            "gpus_per_node": self.gpus_per_node,
            "peak_tflops": {k: v / 1e12 for k, v in self.peak_flops.items()},
            "efficiency": dict(self.efficiency),
            "memory_bandwidth_gbps": self.memory_bandwidth / 1e9,
            "collectives": {f"{n}x{g}": {"bandwidth_gbps": fit.bandwidth / 1e9, "latency_s": fit.latency}
                            for (n, g), fit in sorted(self.links.items())},
            "collective_factor": dict(self.collective_factor),
            "h2d_gbps": self.h2d_bandwidth / 1e9,
            "d2h_gbps": self.d2h_bandwidth / 1e9,
            "slowdown": {f"{a}|{b}": v for (a, b), v in self.slowdown.items()},
            "op_overhead_s": self.op_overhead,
            "reduce_scatter_copies": self.reduce_scatter_copies,
            **({"optimizer_gparams_per_s": self.optimizer_params_per_s / 1e9} if self.optimizer_params_per_s else {}),
            **({"host_optimizer_gparams_per_s": self.host_optimizer_params_per_s / 1e9}
               if self.host_optimizer_params_per_s else {}),
            **({"stream_gbps": self.stream_bandwidth / 1e9} if self.stream_bandwidth else {}),
            **({"compiled_pointwise_ns": dict(self.compiled_pointwise_ns)} if self.compiled_pointwise_ns else {}),
            **({"memory_headroom_gb": self.memory_headroom / 1e9} if self.memory_headroom else {}),
            **({"matmul_shape_model": {"peak_efficiency": self.matmul_model.peak_efficiency,
                                       "half_intensity": self.matmul_model.half_intensity,
                                       "tail_s": self.matmul_model.tail_s}} if self.matmul_model else {}),
            **({"matmul_shapes": [list(point) for point in self.matmul_points]} if self.matmul_points else {}),
            **({"mfu_ceiling": self.mfu_ceiling} if self.mfu_ceiling is not None else {}),
            **({"sustained_compute": self.sustained_compute} if self.sustained_compute != 1.0 else {}),
        }


def with_memory_limit(profile: HardwareProfile, limit: float | str | None) -> HardwareProfile:
    """``profile`` whose plans may use ``limit`` bytes per device (a number or a size string); None: unchanged."""
    if limit is None:
        return profile
    from dataclasses import replace

    limit_bytes = parse_memory(limit) if isinstance(limit, str) else float(limit)
    if not limit_bytes > 0:
        raise ProfileError(f"memory limit must be positive, got {limit!r}")
    return replace(profile, memory_limit=limit_bytes)


def shipped_profiles() -> list[str]:
    if not os.path.isdir(PROFILE_DIR):
        return []
    return sorted(name[:-5] for name in os.listdir(PROFILE_DIR) if name.endswith(".yaml"))


def load_profile(name_or_path: str) -> HardwareProfile:
    """Load a shipped profile by name (``l4``, ``h100-80gb``...) or a YAML file by path."""
    import yaml

    path = name_or_path
    if os.path.isdir(path):
        raise ProfileError(f"hardware profile {path!r} is a directory, not a profile YAML file")
    if not os.path.isfile(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.yaml")
    if not os.path.isfile(path):
        raise ProfileError(
            f"unknown hardware {name_or_path!r}: not a file, and not a shipped profile "
            f"({', '.join(shipped_profiles()) or 'none shipped'})"
        )
    with open(path) as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as error:
            raise ProfileError(f"hardware profile {path!r} is not valid YAML: {error}") from None
    return HardwareProfile.from_dict(data, source=os.path.basename(path))


def save_profile(profile: HardwareProfile, path: str) -> None:
    """Write ``profile`` as YAML that :func:`load_profile` reads back to an equal profile."""
    import yaml

    if os.path.isdir(path):
        raise ProfileError(f"cannot write the hardware profile to {path!r}: it is a directory")
    data = profile.to_dict()
    HardwareProfile.from_dict(data, source=path)  # never write a file we would refuse to load
    with open(path, "w") as handle:
        yaml.safe_dump(data, handle, sort_keys=False, width=100)
