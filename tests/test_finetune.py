"""Fine-tuning the user's real model: the loss the model defines (Hugging Face causal LMs shift their
labels inside), padding weighted as the model weights it, and pretrained out through ``--export``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.pretrained_models import padded_step, save_tiny_llama, trainer_export

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISTC = os.path.join(os.path.dirname(sys.executable), "mistc")


def next_token_loss(model, tokens: torch.Tensor, seq: int = 64) -> float:
    """The model's own mean next-token loss over consecutive windows of ``tokens``."""
    windows = tokens[: len(tokens) // seq * seq].view(-1, seq)
    with torch.no_grad():
        return float(model(input_ids=windows, labels=windows).loss)


def test_the_label_convention_is_read_from_the_model(tmp_path):
    """Hugging Face causal LMs and a module slicing labels[:, 1:] shift inside (fed labels =
    input_ids); the zoo takes the next tokens; the loss's ignore_index comes along."""
    from mist_compiler.frontend.capture import capture
    from mist_compiler.frontend.labels import LabelConvention, label_convention
    from tests.pretrained_models import shifts_inside

    hf = save_tiny_llama(str(tmp_path / "base"))
    assert label_convention(capture(hf, analyse=False)) == LabelConvention(True, -100)
    assert label_convention(capture("gpt-tiny", analyse=False)) == LabelConvention(False, -100)
    assert label_convention(capture(shifts_inside(), analyse=False)) == LabelConvention(True, -1)
    labels = torch.tensor([[5, 6, -100, -100], [7, 8, 9, 10]])
    assert LabelConvention(True).counted(labels).tolist() == [1, 3]  # the first label predicts nothing
    assert LabelConvention(False).counted(labels).tolist() == [2, 4]
    assert LabelConvention(False).share_weights(labels, [(0, 1), (1, 2)], 2) == [2 / 3, 4 / 3]


def test_batches_follow_the_convention():
    from mist_compiler.training.data import SAMPLE_TEXT, TokenSampler, open_tokens

    tokens = open_tokens(SAMPLE_TEXT)
    shifted = TokenSampler(tokens, 4, 32, seed=1).batch(3)
    inside = TokenSampler(tokens, 4, 32, seed=1, shift_labels=False).batch(3)
    assert torch.equal(shifted["input_ids"], inside["input_ids"])
    assert torch.equal(shifted["labels"][:, :-1], shifted["input_ids"][:, 1:])  # the next tokens
    assert torch.equal(inside["labels"], inside["input_ids"])  # the model shifts them itself


def test_mistc_train_fine_tunes_a_pretrained_model_and_exports_it(tmp_path):
    """As a user types it: step 1's loss is the model's own loss on the batch (labels = input_ids, the
    model shifts), held-out next-token loss falls, and the export is a from_pretrained directory."""
    from mist_compiler.training.data import SAMPLE_TEXT, TokenSampler, open_tokens

    spec = save_tiny_llama(str(tmp_path / "base"))
    text = open(SAMPLE_TEXT, "rb").read()
    cut = len(text) * 4 // 5
    (tmp_path / "train.txt").write_bytes(text[:cut])
    held_out = torch.frombuffer(bytearray(text[cut:]), dtype=torch.uint8).long()
    result = subprocess.run([MISTC, "train", spec, "--data", "train.txt", "--steps", "15", "--lr", "3e-3",
                             "--metrics", "metrics.jsonl", "--export", "tuned"], capture_output=True, text=True,
                            timeout=600, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    batch = TokenSampler(open_tokens(str(tmp_path / "train.txt")), 8, 64, 0, shift_labels=False).batch(0)
    with torch.no_grad():
        own = float(base(**batch).loss)
    assert rows[0]["loss"] == pytest.approx(own, rel=1e-5)

    tuned, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tuned"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert tuned.lm_head.weight is tuned.model.embed_tokens.weight
    before, after = next_token_loss(base, held_out), next_token_loss(tuned, held_out)
    assert after < before - 0.3, (before, after)


@pytest.mark.distributed
def test_padding_is_averaged_over_the_batch_as_the_model_does(tmp_path):
    """Rows padded with -100 to different lengths, cut into 2 data-parallel ranks x 2 micro-batches:
    the step's loss and gradients are the model's own on the whole batch."""
    save_tiny_llama(str(tmp_path / "base"))
    result = run_ranks(padded_step, world=2, args=(str(tmp_path / "base"),), timeout_s=300)[0]
    assert result["loss"] == pytest.approx(result["expected"], rel=1e-5)
    assert result["worst_grad"] < 1e-5, result


def test_a_trainer_given_a_module_exports_what_from_pretrained_loads(tmp_path):
    """Trainer(PreTrainedModel) with export=DIR: a save_pretrained directory holding exactly the trained
    weights; the user's module itself is left as it was."""
    folder = str(tmp_path / "base")
    save_tiny_llama(folder)
    result = run_ranks(trainer_export, world=1, args=(folder, str(tmp_path / "out")), timeout_s=300)[0]
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    loaded = exported.state_dict()
    assert set(result["state"]) <= set(loaded)
    assert all(torch.equal(loaded[name], torch.from_numpy(value)) for name, value in result["state"].items())
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert result["untouched"] == float(base.model.norm.weight.detach().sum())
    assert not torch.equal(loaded["model.norm.weight"], base.model.norm.weight)
