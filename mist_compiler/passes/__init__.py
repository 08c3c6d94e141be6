"""IR -> IR passes, one per file, and the pass manager that runs them."""
from .manager import PassError, PassManager, PassResult

__all__ = ["PassError", "PassManager", "PassResult"]
