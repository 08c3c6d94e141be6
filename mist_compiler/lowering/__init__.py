"""Lowering: a plan and the captured program -> this rank's stage program.

:mod:`.lower` is the list of lowering passes (partition, tensor-parallel sharding,
checkpointing, offload) run by the pass manager; :mod:`.materialize` builds the stage's modules
with only this rank's weights. May import ``ir``, ``ops``, ``models`` and ``passes``; nothing
that runs (``runtime``) or decides (``cost``, ``tuner``).
"""
