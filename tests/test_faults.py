"""Faults leave nothing behind: whichever process of ``mistc run`` dies or is signalled, all exit.

Each test starts ``mistc run`` exactly as a user types it (the console script, a long run), waits
for the ranks to train, signals one process (the ``mistc`` parent, torchrun, or a rank) and checks
that every process of the run is gone within seconds, and that the parent, when it survives the
signal, says in one line which process failed and why.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

MISTC = os.path.join(os.path.dirname(sys.executable), "mistc")
PLAN = {"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 1,
        "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 2, "dp": 2, "tp": 1}]}
EXIT_WITHIN_S = 30.0


def children(pid: int) -> list[int]:
    from mist_compiler.launch.agent import worker_pids

    return worker_pids(pid)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Run:
    def __init__(self, tmp_path) -> None:
        plan = tmp_path / "plan.json"
        plan.write_text(json.dumps(PLAN))
        self.process = subprocess.Popen([MISTC, "run", "gpt-tiny", "--plan", str(plan), "--nproc-per-node", "2",
                                         "--steps", "1000000", "--timeout", "30"], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.process.stdout, self.out), (self.process.stderr, self.err)):
            threading.Thread(target=lambda s=stream, k=sink: [k.append(line) for line in s], daemon=True).start()

    def wait_for_training(self, timeout_s: float = 120.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if any("step 3/" in line for line in self.out):
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        self.cleanup()
        raise AssertionError(f"the run did not train: {''.join(self.out)[-1500:]} {''.join(self.err)[-1500:]}")

    def processes(self) -> tuple[int, list[int]]:
        (torchrun,) = children(self.process.pid)
        return torchrun, children(torchrun)

    def cleanup(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def assert_all_exit(pids: list[int]) -> float:
    start = time.time()
    while time.time() - start < EXIT_WITHIN_S:
        if not any(alive(pid) for pid in pids):
            return time.time() - start
        time.sleep(0.2)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"processes {survivors} still run {EXIT_WITHIN_S:.0f} s after the fault")


CASES = [
    ("parent", signal.SIGKILL), ("parent", signal.SIGINT), ("rank", signal.SIGKILL),
    pytest.param("torchrun", signal.SIGKILL, marks=pytest.mark.heavy),  # the suite's time: ~20 s a case
    pytest.param("parent", signal.SIGTERM, marks=pytest.mark.heavy),
    pytest.param("torchrun", signal.SIGTERM, marks=pytest.mark.heavy),
    pytest.param("rank", signal.SIGTERM, marks=pytest.mark.heavy),
]


@pytest.mark.distributed
@pytest.mark.parametrize("victim, sig", CASES, ids=lambda value: getattr(value, "name", value))
def test_a_signalled_process_takes_the_whole_run_down(victim, sig, tmp_path):
    run = Run(tmp_path)
    try:
        run.wait_for_training()
        torchrun, ranks = run.processes()
        assert len(ranks) == 2, ranks
        target = {"parent": run.process.pid, "torchrun": torchrun, "rank": ranks[1]}[victim]
        os.kill(target, sig)
        assert_all_exit([run.process.pid, torchrun, *ranks])
        if victim != "parent" or sig != signal.SIGKILL:
            time.sleep(0.5)  # the reader threads drain the pipes
            err = "".join(run.err)
            lines = [line for line in err.splitlines() if line.startswith("mistc run:")]
            assert len(lines) == 1, err[-2000:]
            assert "Traceback" not in err, err[-2000:]
            expected = {"parent": "interrupted", "torchrun": "torchrun was killed by signal", "rank": "rank "}[victim]
            assert expected in lines[0], lines[0]
            assert run.process.returncode != 0
    finally:
        run.cleanup()
