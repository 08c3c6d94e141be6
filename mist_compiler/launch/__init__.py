"""Starting ranks: torchrun from the process the user started (:mod:`.torchrun`), the per-rank
program of ``mistc run`` (:mod:`.worker`), N local ranks for tests and benchmarks
(:mod:`.local_ranks`). May import everything up to the driver; never the CLI or training.
"""
