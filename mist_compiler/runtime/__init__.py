"""Executing a lowered stage program: the engine's step (:mod:`.engine`), pipeline schedules and
tag-free P2P (:mod:`.pipeline`), ZeRO 0-3 over flat buckets (:mod:`.zero`, :mod:`.stage_runtime`),
offload and side streams, AdamW, loss scaling, tied weights, process groups, failure detection.
May import ``ir``, ``ops``, ``passes`` (plan vocabulary) and ``lowering`` (the stage program type);
never ``frontend``: the runtime never captures.
"""
