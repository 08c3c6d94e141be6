"""Real training on top of the engine: data, LR schedule, parameter groups, global clipping,
metrics, resharding checkpoints (``mistc train``, ``mist_compiler.train``, ``Trainer``). May import
everything up to ``launch``; never the CLI."""
