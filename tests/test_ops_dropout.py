"""Counter-based dropout: the mask is a function of (sample, layer, site, position), so every way
of cutting the batch or the tensor draws the same mask one process draws."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mist_compiler.ops.dropout import counter_attention, counter_dropout, keep_mask, sample_seeds
from mist_compiler.ops.tensor_parallel import _rank_pieces


def _seeds(n: int, step: int = 0) -> torch.Tensor:
    return sample_seeds(0, step, torch.arange(n))


def test_keeps_one_minus_p_and_rescales():
    x = torch.ones(64, 16, 32)
    out = counter_dropout(x, 0.1, _seeds(64), 3, 0)
    kept = (out != 0).float().mean().item()
    assert abs(kept - 0.9) < 0.01
    assert torch.allclose(out[out != 0], torch.full_like(out[out != 0], 1 / 0.9))
    assert torch.equal(out, counter_dropout(x, 0.1, _seeds(64), 3, 0))  # deterministic


def test_layers_sites_steps_and_samples_draw_different_masks():
    shape = (4, 8, 16)
    base = keep_mask(shape, 0.5, _seeds(4), 0, 0)
    for other in (keep_mask(shape, 0.5, _seeds(4), 1, 0), keep_mask(shape, 0.5, _seeds(4), 0, 1),
                  keep_mask(shape, 0.5, _seeds(4, step=1), 0, 0)):
        assert (base != other).float().mean() > 0.3
    assert (base[0] != base[1]).float().mean() > 0.3  # samples differ


def test_a_slice_of_the_batch_draws_the_rows_of_the_whole_batch():
    whole = keep_mask((8, 5, 6), 0.3, _seeds(8), 2, 1)
    rows = torch.arange(2, 6)
    part = keep_mask((4, 5, 6), 0.3, sample_seeds(0, 0, rows), 2, 1)
    assert torch.equal(part, whole[2:6])
    flat = keep_mask((8 * 5, 6), 0.3, _seeds(8), 2, 1)  # [batch * seq, features] (batch outermost)
    assert torch.equal(flat.view(8, 5, 6), whole)


def _part(mask: torch.Tensor, rank: int, world: int, dim: int, block: int, parts: tuple) -> torch.Tensor:
    pieces = _rank_pieces(mask.contiguous(), rank, world, dim, block, parts)
    local = torch.cat(pieces, dim=dim + 1) if len(pieces) > 1 else pieces[0]
    return local.reshape(*mask.shape[:dim], -1, *mask.shape[dim + 1:])


def test_a_tensor_parallel_rank_draws_its_part_of_the_whole_mask():
    world = 2
    cases = [((3, 4, 12), 2, 12, ()),  # features split
             ((3, 4, 12), 2, 12, (6, 4, 2)),  # a fused q|k|v projection split part by part
             ((3, 8, 4, 5), 1, 8, ()),  # heads of the attention probabilities
             ((3 * 6, 4, 4), 0, 6, ())]  # Bloom's merged batch * heads (6 heads per sample)
    for shape, dim, block, parts in cases:
        whole = keep_mask(shape, 0.4, _seeds(3), 1, 2)
        for rank in range(world):
            local_shape = list(shape)
            local_shape[dim] //= world
            split = (dim, block, parts, rank, world)
            mine = keep_mask(tuple(local_shape), 0.4, _seeds(3), 1, 2, split)
            assert torch.equal(mine, _part(whole, rank, world, dim, block, parts)), (shape, dim, parts, rank)


def test_counter_attention_is_attention_with_its_dropout():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    seeds = _seeds(2)
    without = counter_attention(q, k, v, None, 0.0, True, None, True, seeds=seeds, layer=0, site=0)
    assert torch.allclose(without, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), atol=1e-6)
    with_dropout = counter_attention(q, k, v, None, 0.5, True, None, True, seeds=seeds, layer=0, site=0)
    assert not torch.allclose(with_dropout, without)
