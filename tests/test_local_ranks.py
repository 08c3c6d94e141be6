"""The local-rank launcher (``mist_compiler.launch.local_ranks``): ranks forked from its fork server
see the caller's environment and directory at the call, and failures and hangs come back as errors."""
from __future__ import annotations

import os
import time

import pytest

from tests.dist_utils import RankError, run_ranks


def _where_am_i(rank: int, world: int, name: str) -> tuple:
    import torch.distributed as dist

    return rank, world, dist.get_world_size(), os.environ.get(name), os.getcwd(), os.environ["OMP_NUM_THREADS"]


def _fail_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one was told to fail")
    return rank


def _sleep(rank: int, world: int, seconds: float) -> None:
    time.sleep(seconds)


def test_ranks_see_the_callers_environment_and_directory_at_the_call(monkeypatch, tmp_path):
    run_ranks(_where_am_i, world=1, args=("MIST_TEST_LOCAL_RANKS",))  # the fork server is running now
    monkeypatch.setenv("MIST_TEST_LOCAL_RANKS", "set after the server started")
    monkeypatch.chdir(tmp_path)
    results = run_ranks(_where_am_i, world=2, args=("MIST_TEST_LOCAL_RANKS",))
    assert results == [(rank, 2, 2, "set after the server started", str(tmp_path), "1") for rank in range(2)]


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankError, match=r"(?s)rank 1 .*ValueError: rank one was told to fail"):
        run_ranks(_fail_on_rank_one, world=2)


def test_a_hung_rank_is_killed_at_the_timeout():
    started = time.perf_counter()
    with pytest.raises(RankError, match="timed out after 2 s"):
        run_ranks(_sleep, world=2, args=(60.0,), timeout_s=2.0)
    assert time.perf_counter() - started < 30
