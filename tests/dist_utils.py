"""The tests' name for the package's local-rank launcher (``mist_compiler.launch.local_ranks``)."""
from mist_compiler.launch.local_ranks import RankError, free_port, run_ranks

__all__ = ["RankError", "free_port", "run_ranks"]
