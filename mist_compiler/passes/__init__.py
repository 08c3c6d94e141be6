"""IR -> IR passes, one per file, and the pass manager that runs them. May import ``ir``, ``ops``
and ``models`` only."""
from .manager import PassError, PassManager, PassResult

__all__ = ["PassError", "PassManager", "PassResult"]
