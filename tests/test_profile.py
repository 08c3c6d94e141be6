"""``mistc profile``: measuring this machine produces a profile that loads; fits are sound."""
from __future__ import annotations

import argparse
import re

import numpy as np
import pytest

from mist_compiler.cli import profile as profile_command
from mist_compiler.cost.comm import collective_time
from mist_compiler.cost.hardware import CHANNELS, ProfileError, load_profile
from mist_compiler.profiling.comm import fit_alpha_beta, fit_collectives
from mist_compiler.profiling.profiler import profile_machine
from mist_compiler.profiling.timing import ProfilerOptions


def _run_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    profile_command.add_arguments(parser)
    return profile_command.run(parser.parse_args(argv))


def test_fit_alpha_beta_recovers_a_line():
    x = np.array([1e5, 1e6, 1e7])
    bandwidth, latency = fit_alpha_beta(x, x / 2e9 + 3e-4)
    assert bandwidth == pytest.approx(2e9) and latency == pytest.approx(3e-4)


def test_fit_alpha_beta_never_returns_negative_latency():
    bandwidth, latency = fit_alpha_beta(np.array([1e6, 2e6]), np.array([0.9e-3, 2.1e-3]))
    assert latency == 0.0 and bandwidth > 0


def test_fit_collectives_recovers_factors_of_synthetic_timings():
    sizes = [1 << 16, 1 << 20, 1 << 23]
    bandwidth, latency = 1.5e9, 2e-4
    factors = {"all_gather": 1.0, "reduce_scatter": 1.1, "all_reduce": 2.1, "broadcast": 0.8, "all_to_all": 1.3}
    results = []
    for world in (2, 4):
        times = {kind: [(b, b * (world - 1) / world / bandwidth * f + latency) for b in sizes] for kind, f in factors.items()}
        times["p2p"] = [(b, b / bandwidth * 0.5 + latency) for b in sizes]
        results.append({"world": world, "times": times, "slowdown": {}})
    links, fitted = fit_collectives(results)
    assert set(links) == {"1x2", "1x4"}
    assert links["1x4"]["bandwidth_gbps"] == pytest.approx(1.5, rel=1e-4)
    assert links["1x2"]["latency_s"] == pytest.approx(2e-4, rel=1e-2)
    for kind, factor in factors.items():
        assert fitted[kind] == pytest.approx(factor, rel=1e-3)
    assert fitted["p2p"] == pytest.approx(0.5, rel=1e-3)


@pytest.mark.distributed
def test_quick_profile_writes_a_loadable_profile(tmp_path, capfd):
    output = tmp_path / "here.yaml"
    assert _run_command(["-o", str(output), "--quick", "--name", "this-machine", "--world-sizes", "2"]) == 0
    profile = load_profile(str(output))
    assert profile.name == "this-machine"
    assert (1, 2) in profile.links and profile.links[(1, 2)].bandwidth > 0
    assert all(op in profile.efficiency for op in ("matmul", "attention", "elementwise", "reduction", "norm", "softmax",
                                                   "default"))
    assert profile.peak_flops["float32"] > 1e8  # any CPU core does 0.1 GFLOP/s
    assert 0 < profile.op_overhead < 1e-3
    assert len(profile.matmul_points) >= 3 and profile.matmul_model is not None  # the GEMM shape table and its fit
    assert {a for a, _ in profile.slowdown} == set(CHANNELS) and len(profile.slowdown) == 12
    assert float(collective_time(profile, "all_reduce", 1e6, 1, 2)) > 0
    captured = capfd.readouterr()
    assert "matmul" in captured.err and "all_reduce" in captured.err  # progress lines
    assert "wrote" in captured.out


def test_single_device_profile_borrows_links(monkeypatch):
    monkeypatch.setattr("mist_compiler.profiling.profiler.measure_compute", _fake_compute)
    profile = profile_machine(ProfilerOptions(quick=True, world_sizes=(), links_from="l4", log=lambda m: None))
    l4 = load_profile("l4")
    assert profile.links == l4.links and profile.gpus_per_node == l4.gpus_per_node
    assert profile.slowdown[("compute", "collective")] == l4.slowdown[("compute", "collective")]
    assert ("h2d", "d2h") in profile.slowdown  # measured locally
    assert "copied from profile 'l4'" in profile.description
    assert profile.efficiency == {"matmul": 0.8, "attention": 0.4, "elementwise": 0.8, "reduction": 0.9,
                                  "norm": 0.6, "softmax": 0.7, "default": 0.75}


def test_recalibrate_compute_keeps_links_and_replaces_compute(monkeypatch):
    from mist_compiler.profiling.profiler import recalibrate_compute

    monkeypatch.setattr("mist_compiler.profiling.profiler.measure_compute", _fake_compute)
    l4 = load_profile("l4")
    profile = recalibrate_compute(l4, ProfilerOptions(device="cpu", log=lambda m: None))
    assert profile.links == l4.links and profile.slowdown == l4.slowdown and profile.h2d_bandwidth == l4.h2d_bandwidth
    assert profile.peak_flops["float32"] == pytest.approx(5e10) and profile.peak_flops["bfloat16"] == l4.peak_flops["bfloat16"]
    assert profile.memory_bandwidth == pytest.approx(2e10) and profile.op_overhead == pytest.approx(4e-6)
    assert profile.efficiency["matmul"] == pytest.approx(0.8) and "re-measured" in profile.description


def test_no_collective_group_without_links_from_is_an_error():
    with pytest.raises(ProfileError, match="links_from"):
        profile_machine(ProfilerOptions(quick=True, world_sizes=(), log=lambda m: None))


@pytest.mark.parametrize("argv, named", [
    (["-o", "/no/such/dir/p.yaml", "--quick"], "--output"),
    (["-o", "p.yaml", "--timeout", "0"], "--timeout"),
])
def test_command_rejects_bad_options(argv, named):
    with pytest.raises(ValueError, match=named):
        _run_command(argv)


def test_world_size_beyond_the_machine_is_named():
    with pytest.raises(ProfileError, match="world_sizes"):
        profile_machine(ProfilerOptions(quick=True, world_sizes=(4096,), log=lambda m: None))


def test_world_sizes_option_parsing():
    parser = argparse.ArgumentParser()
    profile_command.add_arguments(parser)
    assert parser.parse_args(["-o", "x", "--world-sizes", "2,4"]).world_sizes == (2, 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["-o", "x", "--world-sizes", "1"])


def _fake_compute(device, options):
    from mist_compiler.profiling.profiler import ComputeMeasurements

    return ComputeMeasurements({"float32": 5e10}, 4e10, 2e10, 2e10, 1.6e10, 1.8e10, 1e10, 1e10, "float32", 1.2e10, 1.4e10, 4e-6)


@pytest.mark.distributed
def test_overrunning_ranks_are_killed_with_a_clear_error(monkeypatch):
    import subprocess

    from mist_compiler.profiling import comm as profile_comm

    started: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        process = real_popen(*args, **kwargs)
        started.append(process)
        return process

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    with pytest.raises(RuntimeError, match="did not finish within"):
        profile_comm.run_collective_group(2, "cpu", ProfilerOptions(quick=True, log=lambda m: None),
                                      measure_concurrency=False, timeout_s=0.3)
    assert len(started) == 2 and all(process.poll() is not None for process in started)


@pytest.mark.heavy
def test_torchrun_over_two_simulated_nodes_measures_the_inter_node_shape(tmp_path):
    """Two torchrun agents on this machine, one rank each, stand in for two nodes (shape 2x1)."""
    import os
    import subprocess
    import sys

    from mist_compiler.profiling.timing import _free_port

    script = tmp_path / "profile_rank.py"
    script.write_text("import argparse, sys\n"
                      "from mist_compiler.cli import profile as profile_command\n"
                      "parser = argparse.ArgumentParser(); profile_command.add_arguments(parser)\n"
                      "sys.exit(profile_command.run(parser.parse_args(sys.argv[1:])))\n")
    output = tmp_path / "cluster.yaml"
    port = str(_free_port())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
                                str(script), "-o", str(output), "--quick", "--name", "two-nodes"], env=env)
              for node in (0, 1)]
    try:
        assert [agent.wait(timeout=240) for agent in agents] == [0, 0]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    profile = load_profile(str(output))
    assert profile.name == "two-nodes" and profile.gpus_per_node == 1
    assert set(profile.links) == {(2, 1)} and profile.links[(2, 1)].bandwidth > 0
    assert "torchrun over 2 node(s)" in profile.description


@pytest.mark.heavy
def test_overlap_model_predicts_three_cpu_channels_run_together():
    """Pairwise factors measured here, combined by overlap.py, against compute + h2d + d2h run at once."""
    import threading
    import time

    import torch

    from mist_compiler.cost.hardware import HardwareProfile
    from mist_compiler.cost.overlap import overlap
    from mist_compiler.profiling.comm import _Channel, measure_slowdowns

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        factors = measure_slowdowns("cpu", ProfilerOptions(log=lambda m: None), distributed=False)
        data = load_profile("cpu").to_dict()
        data["slowdown"] = factors
        profile = HardwareProfile.from_dict(data)
        channels = {name: _Channel(name, "cpu", False) for name in ("compute", "h2d", "d2h")}
        steps = {"compute": 400, "h2d": 60, "d2h": 60}
        alone = {name: min(channels[name].run(steps[name]) for _ in range(2)) for name in channels}
        finished: dict[str, float] = {}
        start = time.perf_counter()

        def run(name: str) -> None:
            channels[name].run(steps[name])
            finished[name] = time.perf_counter() - start

        workers = [threading.Thread(target=run, args=(name,)) for name in channels]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        torch.set_num_threads(threads)
    predicted = float(overlap(profile, alone["compute"], 0.0, alone["h2d"], alone["d2h"]).total_s)
    assert predicted == pytest.approx(max(finished.values()), rel=0.35)


@pytest.mark.parametrize("quick", [False, True])
def test_collective_slowdown_channel_uses_the_largest_timed_message(quick):
    """The collective that slowdowns are measured with is in the bandwidth regime of gradient buckets
    (a small gloo all-reduce is latency-bound and barely competes with compute for the cores)."""
    from mist_compiler.profiling.comm import _Channel, _message_sizes

    channel = _Channel("collective", "cpu", quick)
    assert channel.buffer.numel() * channel.buffer.element_size() == max(_message_sizes("cpu", quick))


def test_sustained_fraction_compares_late_gemms_with_the_first():
    from mist_compiler.profiling.compiled import sustained_fraction

    lines = []
    fraction = sustained_fraction("cpu", "float32", 128, 0.5, lambda: None, lines.append)
    assert 0.0 < fraction <= 1.0 and "sustained GEMM rate" in lines[0]


@pytest.mark.heavy
def test_the_compiled_layer_chain_is_timed_as_one_memory_pass(tmp_path, monkeypatch):
    """An inductor compile (tens of seconds on a CPU): the fused chain moves its one-pass bytes faster
    than the same ops run eagerly, each with its own pass."""
    import torch

    from mist_compiler.profiling.compiled import fused_bytes_per_s
    from mist_compiler.profiling.timing import seconds_per_call

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.set_num_threads(1)
    lines = []
    rate = fused_bytes_per_s("cpu", "float32", 1024, 512, lambda fn: seconds_per_call(fn, lambda: None, 0.1),
                             lines.append)
    eager = float(re.search(r"eager ops: ([\d.]+)", lines[0]).group(1)) * 1e9
    assert rate > eager > 0


def test_the_host_adamw_rate_is_timed_as_the_backend_runs_it(monkeypatch):
    """Offloaded optimizer states are updated in chunks on the host worker threads; the profile times
    that (one thread's rate priced an H200's 50%-offloaded step 2.5x slow)."""
    import threading

    from mist_compiler.profiling import state_rates
    from mist_compiler.runtime import kernels

    monkeypatch.setenv("MIST_HOST_THREADS", "2")
    calls, original = [], kernels.adamw

    def adamw(param, *args, **kwargs):
        calls.append((threading.current_thread().name, param.numel()))
        return original(param, *args, **kwargs)

    monkeypatch.setattr(kernels, "adamw", adamw)
    once = lambda step, sync, target: (step(), sync(), 0.01)[-1]  # noqa: E731
    assert state_rates.host_adamw_params_per_s(1 << 18, 0.01, timer=once) == pytest.approx((1 << 18) / 0.01)
    assert [numel for _, numel in calls] == [1 << 17, 1 << 17]  # one chunk per worker thread
    assert all(name.startswith("mist-host") for name, _ in calls)


def test_a_measured_peak_is_the_best_gemm_rate_of_the_run():
    """A large GEMM timed while other work ran can come out below a later shape's rate: the peak is
    then raised to the best rate and the shape table re-expressed against it (a profile never prices
    a GEMM above its device's peak, and its own loader accepts it)."""
    from mist_compiler.profiling.profiler import _best_gemm_as_peak

    points = [(128, 128, 128, 1.7), (512, 64, 512, 0.85)]
    peak, rescaled = _best_gemm_as_peak(100e9, 120e9, points, lambda line: None)
    assert peak == pytest.approx(170e9)
    assert rescaled == [(128, 128, 128, 1.0), (512, 64, 512, 0.5)]
    assert _best_gemm_as_peak(100e9, 90e9, [(64, 64, 64, 0.9)], lambda line: None) == (100e9, [(64, 64, 64, 0.9)])
