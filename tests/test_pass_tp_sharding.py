"""Tensor-parallel sharding: column/row roles by data flow, and equal losses/grads on 2 ranks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mist_compiler.backends.tensor_parallel import TensorParallelError
from mist_compiler.models import build_model
from mist_compiler.passes.tp_sharding import linear_roles
from tests.dist_utils import run_ranks


def test_roles_of_gpt_and_llama_blocks():
    gpt = linear_roles(build_model("gpt-tiny").blocks[0])
    assert gpt == {"attn.q": "column", "attn.k": "column", "attn.v": "column", "attn.o": "row",
                   "mlp.up": "column", "mlp.down": "row"}
    llama = linear_roles(build_model("llama-tiny").blocks[0])
    assert llama["mlp.gate"] == "column" and llama["mlp.up"] == "column" and llama["mlp.down"] == "row"


class NormAfterColumn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.up(x)
        return x + self.down(F.layer_norm(h, h.shape[-1:]))


class ShardedOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.up(x)


def test_structures_that_cannot_be_sharded_are_named():
    with pytest.raises(TensorParallelError, match="layer_norm reduces over tensor-parallel-sharded features"):
        linear_roles(NormAfterColumn(), "odd")
    with pytest.raises(TensorParallelError, match="mixes sharded and replicated"):
        linear_roles(ShardedOutput(), "odd")


def _sharded_vs_whole(rank: int, world: int, name: str):
    import torch.distributed as dist

    from mist_compiler.backends.tensor_parallel import shard_dims
    from mist_compiler.ir.plan import Plan
    from mist_compiler.passes.partition import Partition, trace_model
    from mist_compiler.passes.tp_sharding import TensorParallel

    plan = Plan.from_dict({"model": name, "seq_len": 8, "global_batch": 2, "dtype": "float32", "grad_accum": 1,
                           "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 2, "micro_batch": 2, "dp": 1, "tp": 2}]})
    model = build_model(name)
    batch = {"input_ids": torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1)),
             "labels": torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(2))}
    whole = Partition(plan, 0)(trace_model(model)).program
    sharded = TensorParallel(dist.group.WORLD, rank, world)(whole).program
    loss = sharded(**batch)
    loss.backward()
    reference = model(**batch)
    reference.backward()
    worst = 0.0
    dims = shard_dims(sharded)
    for param_name, param in sharded.named_parameters():
        dim = dims[param_name]
        grad = param.grad
        if dim is not None:
            parts = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(parts, grad.contiguous())
            grad = torch.cat(parts, dim=dim)
        expected = dict(model.named_parameters())[param_name].grad
        worst = max(worst, float((grad - expected).norm() / expected.norm()))
    return float(loss), float(reference), worst


@pytest.mark.distributed
def test_sharded_program_gives_the_losses_and_gradients_of_the_whole_model():
    for name in ("gpt-tiny", "llama-tiny"):
        results = run_ranks(_sharded_vs_whole, world=2, args=(name,), timeout_s=120)
        for loss, reference, worst in results:
            assert abs(loss - reference) <= 1e-5 * abs(reference), (name, loss, reference)
            assert worst <= 1e-5, (name, worst)
