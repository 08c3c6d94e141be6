"""``mistc profile -o FILE``: measure this machine (compute, memory, collectives, copies, interference)
into a hardware profile YAML that ``--hardware FILE`` and ``load_profile(FILE)`` accept.

Progress goes to stderr, one line per measurement. On CPU every core is one rank (gloo); on GPUs
every GPU is one rank (NCCL). Takes well under five minutes; ``--quick`` is a smaller, rougher pass.
For inter-node links run it on every node under torchrun, e.g.
``torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT -m mist_compiler.cli profile -o cluster.yaml``.
"""
from __future__ import annotations

import argparse

from mist_compiler.cost.hardware import save_profile


def _world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world-sizes: expected comma-separated integers, got {text!r}") from None
    if not sizes or any(size < 2 for size in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes: every group needs >= 2 ranks, got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the profile (YAML)")
    parser.add_argument("--name", help="profile name (default: measured-cpu / measured-cuda)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, shorter timings (a few seconds; rough)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="what to profile (default: auto)")
    parser.add_argument("--world-sizes", type=_world_sizes, default=None, metavar="N,M",
                        help="local group sizes to time collectives over (default: 2,4 on CPU, 2,4,8 on GPU, as available)")
    parser.add_argument("--links-from", metavar="PROFILE",
                        help="on a single-device machine, take collective fits from this shipped profile or file")
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=None,
                        help="time a layer's elementwise chain compiled by inductor (efficiency 'fused'; tens of "
                             "seconds of compiling on a CPU; default: on, off with --quick)")
    parser.add_argument("--sustain-s", type=float, default=None, metavar="SECONDS",
                        help="seconds of back-to-back GEMMs to measure the rate held under load (sustained_compute; "
                             "default: 20 on a GPU, 0 = not measured elsewhere)")
    parser.add_argument("--timeout", type=float, default=240.0, metavar="SECONDS",
                        help="limit for the spawned collective ranks (default: 240)")


def run(args: argparse.Namespace) -> int:
    from mist_compiler.ir.files import check_output
    from mist_compiler.profiling.profiler import ProfilerOptions, launched_by_torchrun, profile_cluster, profile_machine

    check_output(args.output, "-o/--output")  # a directory, a missing folder: refused before minutes of measuring
    if args.timeout <= 0:
        raise ValueError(f"--timeout: must be positive, got {args.timeout}")
    if args.sustain_s is not None and args.sustain_s < 0:
        raise ValueError(f"--sustain-s: must be >= 0, got {args.sustain_s}")
    options = ProfilerOptions(quick=args.quick, device=args.device, world_sizes=args.world_sizes, name=args.name,
                              links_from=args.links_from, timeout_s=args.timeout, compiled=args.compiled,
                              sustain_s=args.sustain_s)
    if launched_by_torchrun():  # one rank of a (multi-node) job: the first rank writes the file
        for flag, value in (("--world-sizes", args.world_sizes), ("--links-from", args.links_from)):
            if value is not None:
                raise ValueError(f"{flag}: not used under torchrun (the job's own nodes x ranks are measured)")
        profile = profile_cluster(options)
        if profile is None:
            return 0
    else:
        profile = profile_machine(options)
    save_profile(profile, args.output)
    matmul = max(profile.peak_flops.values()) * profile.efficiency_of("matmul")
    links = ", ".join(f"{n}x{g} {fit.bandwidth / 1e9:.3g} GB/s + {fit.latency * 1e6:.0f} us"
                      for (n, g), fit in sorted(profile.links.items()))
    print(f"wrote {args.output}: {profile.name}, {profile.gpus_per_node} devices per node, "
          f"matmul {matmul / 1e12:.3g} TFLOP/s, memory {profile.memory_bandwidth / 1e9:.3g} GB/s, links {links}")
    return 0
