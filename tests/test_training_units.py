"""The trainer's pieces alone: flat ranges -> boxes of full tensors, data files and sampling, the LR
schedule, parameter groups; and one rank's training against torch.optim.AdamW with groups and
clip_grad_norm_ (the recipe the fused flat optimizer must reproduce)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mist_compiler.ir.model_graph import ShardSpec
from mist_compiler.training.data import DataError, TokenSampler, open_tokens
from mist_compiler.training.layout import box_view, piece_to_full, range_boxes
from mist_compiler.training.optim import LRSchedule, decays
from tests.dist_utils import run_ranks


def _box(tensor: torch.Tensor, box) -> torch.Tensor:
    return tensor[tuple(slice(o, o + s) for o, s in zip(*box))]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
def test_any_flat_range_is_covered_by_its_boxes_exactly_once(shape):
    numel = math.prod(shape)
    full = torch.arange(numel).reshape(shape)
    for lo in range(numel + 1):
        for hi in range(lo, numel + 1):
            boxes = range_boxes(shape, lo, hi)
            assert len(boxes) <= 2 * len(shape) - 1
            values = sorted(v for box in boxes for v in _box(full, box).reshape(-1).tolist())
            assert values == list(range(lo, hi))
            flat = full.reshape(-1)[lo:hi].clone()
            assert all(torch.equal(box_view(flat, lo, shape, box), _box(full, box)) for box in boxes)


@pytest.mark.parametrize("spec", [ShardSpec(0), ShardSpec(1), ShardSpec(0, (4, 8, 4))])
def test_tensor_parallel_pieces_map_back_onto_the_full_tensor(spec):
    tp, full = 2, torch.arange(16 * 6).reshape(16, 6)
    rebuilt = torch.full_like(full, -1)
    for rank in range(tp):
        piece = torch.cat([full.narrow(spec.dim, s.start, s.stop - s.start)
                           for s in spec.rank_slices(full.shape[spec.dim], rank, tp)], dim=spec.dim)
        for lo, hi in ((0, 5), (5, 31), (31, piece.numel())):  # arbitrary ZeRO-like cuts through the piece
            for box in range_boxes(tuple(piece.shape), lo, hi):
                for local, target in piece_to_full(box, tuple(piece.shape), spec, rank, tp):
                    _box(rebuilt, target).copy_(_box(piece, local))
    assert torch.equal(rebuilt, full)


def test_token_files_text_files_and_their_errors(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 500
    ids.tofile(tmp_path / "a.bin")
    assert np.array_equal(open_tokens(str(tmp_path / "a.bin")), ids)
    (ids.astype(np.uint32) + 70000).tofile(tmp_path / "b.u32.bin")
    assert int(open_tokens(str(tmp_path / "b.u32.bin"))[0]) == 70000
    (tmp_path / "t.txt").write_text("héllo")
    assert open_tokens(str(tmp_path / "t.txt")).tolist() == list("héllo".encode())
    with pytest.raises(DataError, match="does not exist"):
        open_tokens(str(tmp_path / "none.bin"))
    (tmp_path / "odd.u32.bin").write_bytes(b"12345")
    with pytest.raises(DataError, match="whole number"):
        open_tokens(str(tmp_path / "odd.u32.bin"))
    with pytest.raises(DataError, match="fewer than one global batch"):
        TokenSampler(ids, global_batch=8, seq_len=128)
    with pytest.raises(DataError, match="vocabulary has 256"):
        TokenSampler(ids, global_batch=2, seq_len=16).check_vocab(256)
    with pytest.raises(DataError, match="vocabulary has 300"):  # the ranks' per-batch check
        [TokenSampler(ids, global_batch=2, seq_len=16, vocab=300).batch(step) for step in range(20)]


def test_batches_depend_on_seed_and_step_only():
    tokens = np.arange(5000, dtype=np.uint16)
    sampler = TokenSampler(tokens, global_batch=4, seq_len=8, seed=3)
    a, b = sampler.batch(7), TokenSampler(tokens, global_batch=4, seq_len=8, seed=3).batch(7)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], a["input_ids"] + 1)
    assert not torch.equal(sampler.batch(8)["input_ids"], a["input_ids"])


def test_schedule_and_parameter_groups():
    schedule = LRSchedule(lr=1.0, total=10, warmup=2, min_lr=0.1)
    assert [schedule(s) for s in (1, 2)] == [0.5, 1.0]
    assert schedule(10) == pytest.approx(0.1) and schedule(6) == pytest.approx(0.55)
    assert decays("blocks.0.attn.q.weight", (64, 64)) and decays("head.weight", (512, 64))
    assert not any(decays(n, s) for n, s in (("embed.weight", (512, 64)), ("transformer.wte.weight", (9, 4)),
                                              ("blocks.0.attn_norm.weight", (64,)), ("blocks.0.mlp.up.bias", (8,))))


def _one_rank(rank: int, world: int, config: dict) -> dict:
    from mist_compiler.training.trainer import TrainConfig, Trainer

    plan = {"model": "gpt-tiny", "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": 2,
            "stages": [{"layers": [0, 4], "nodes": 1, "gpus_per_node": 1, "micro_batch": 2, "dp": 1, "tp": 1}]}
    trainer = Trainer("gpt-tiny", plan, TrainConfig.from_dict(config), say=lambda line: None)
    rows = trainer.fit()
    weights = trainer.engine.gather_full_state()
    trainer.close()
    return {"rows": rows, "weights": {name: t.numpy() for name, t in weights.items()}}  # tensors do not outlive the rank


def test_one_rank_trains_like_torch_adamw_with_groups_and_clipping():
    from mist_compiler.frontend.joint import model_call_kwargs
    from mist_compiler.models import build_model
    from mist_compiler.training.data import SAMPLE_TEXT
    from mist_compiler.verify.check import loss_of

    optim = {"lr": 1e-2, "min_lr": 1e-3, "warmup": 1, "weight_decay": 0.1, "clip": 0.5}
    got = run_ranks(_one_rank, world=1, args=({"steps": 4, "optim": optim, "timeout_s": 60},), timeout_s=120)[0]
    model = build_model("gpt-tiny", seq_len=16)
    named = dict(model.named_parameters())
    groups = [{"params": [p for n, p in named.items() if decays(n, tuple(p.shape))], "weight_decay": 0.1},
              {"params": [p for n, p in named.items() if not decays(n, tuple(p.shape))], "weight_decay": 0.0}]
    reference = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    sampler = TokenSampler(open_tokens(SAMPLE_TEXT), 4, 16)
    schedule = LRSchedule(1e-2, 4, 1, 1e-3)
    for step, row in enumerate(got["rows"]):
        loss = loss_of(model(**sampler.batch(step), **model_call_kwargs(model)))
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        for group in reference.param_groups:
            group["lr"] = schedule(step + 1)
        reference.step()
        reference.zero_grad()
        assert row["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
        assert row["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert row["lr"] == pytest.approx(schedule(step + 1))
    for name, tensor in got["weights"].items():  # an embedding or norm decayed by mistake would be off by ~1e-3
        want = named[name].detach()
        assert float((torch.from_numpy(tensor) - want).norm() / want.norm()) < 1e-4, name


def test_python_api_exports_train_and_trainer():
    import mist_compiler
    from mist_compiler.training.trainer import Trainer

    assert mist_compiler.Trainer is Trainer and {"train", "Trainer", "TrainConfig"} <= set(mist_compiler.__all__)
    with pytest.raises(TypeError, match="unknown option"):
        mist_compiler.train("gpt-tiny", steps=2, no_such_flag=1)
