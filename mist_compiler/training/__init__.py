"""Real training on top of the engine: data, LR schedule, parameter groups, global clipping,
metrics, resharding checkpoints (``mistc train``, ``mist_compiler.train``, ``Trainer``)."""
