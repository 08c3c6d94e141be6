"""Heavy (excluded from CI): the tuning-time bar of DESIGN.md on the real cost model."""
from __future__ import annotations

import pytest

from mist_compiler import driver
from mist_compiler.tuner.api import tune
from mist_compiler.tuner.space import Cluster


@pytest.mark.heavy
def test_gpt22b_on_32_l4_tunes_in_seconds():
    """The DESIGN.md bar: GPT-22B, 4 x 8 L4, global batch 512, full space, in under 30 s of CPU."""
    import time

    program, model = driver.price("gpt2-22b", "l4", seq_len=2048)
    clock = time.process_time()
    result = tune(model, driver.workload(program, 512, 2048), Cluster(4, 8))
    assert time.process_time() - clock < 30
    assert result.plan.world_size == 32
    assert all(report.peak_memory_bytes <= model.device_memory_bytes for report in result.stages)
