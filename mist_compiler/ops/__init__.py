"""Custom torch ops that may appear in captured graphs (a leaf package: imports torch, triton and
numpy only, nothing else of ours).

- ``mist::linear_cross_entropy`` (:mod:`.linear_cross_entropy`): the LM head's matmul fused with
  the cross-entropy loss, computed by slices of the vocabulary so that no ``N x V`` logits exist;
  its backward recomputes each slice; registered fake, autograd and FLOP formulas, and the closed form of its
  transient memory;
- :mod:`.chunk_kernels`: the per-slice softmax / loss / gradient math (Triton, torch twins);
- :mod:`.vocab_parallel`: the same loss over a vocabulary shard of the head (tensor parallelism);
- :mod:`.groups`: what tensor-parallel ops reduce over (a process group, or threads as ranks);
- :mod:`.sequence_parallel`: sequence parallelism's all-gather / reduce-scatter pair as modules;
- :mod:`.saved_tags`: markers naming the running node for the per-tensor activation policy's hooks;
- :mod:`.fuse`: ``fuse_linear_cross_entropy(gm)``, the rewrite of a dynamo torch-level graph that
  puts the op in place of head-linear -> [float] -> [view/reshape] -> cross_entropy.
"""
from .fuse import fuse_linear_cross_entropy
from .linear_cross_entropy import slice_columns, linear_cross_entropy, workspace_points
from .vocab_parallel import vocab_parallel_linear_cross_entropy

__all__ = ["slice_columns", "fuse_linear_cross_entropy", "linear_cross_entropy", "vocab_parallel_linear_cross_entropy",
           "workspace_points"]
