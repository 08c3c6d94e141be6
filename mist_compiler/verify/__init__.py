"""Proofs and checks: a tensor-parallel split proven on the model before training
(:mod:`.tp_check`) and ``--check``, a plan's training against one-process training
(:mod:`.check`). May import ``lowering`` and ``runtime``.
"""
