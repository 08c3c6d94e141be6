"""Pretrained in: ``hf:DIR`` and factories calling ``from_pretrained`` train from the saved weights,
each rank reading only the slices it keeps, tied weights tied; ambiguous or unreadable inputs are
refused in one line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.pretrained_models import save_tiny_llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISTC = os.path.join(os.path.dirname(sys.executable), "mistc")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("pretrained") / "llama")
    spec = save_tiny_llama(folder)
    return folder, spec, transformers.AutoModelForCausalLM.from_pretrained(folder)


def _mistc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([MISTC, *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})


def test_hf_dir_builds_the_saved_weights_with_the_head_still_tied(checkpoint):
    from mist_compiler.models import build_model

    folder, spec, reference = checkpoint
    model = build_model(spec)  # seeded initialisation must not touch pretrained modules
    expected = reference.state_dict()
    assert all(torch.equal(model.state_dict()[name], value) for name, value in expected.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_rank_reads_only_the_slices_it_keeps(checkpoint, monkeypatch):
    from mist_compiler.ir.model_graph import BUFFER, PARAMETER, ShardSpec
    from mist_compiler.lowering.materialize import InitTensors, read_shard
    from mist_compiler.models.pretrained import Checkpoint

    folder, spec, reference = checkpoint
    reads = []
    original = Checkpoint.read
    monkeypatch.setattr(Checkpoint, "read", lambda self, name, dim=0, slices=None: (
        reads.append((name, dim, slices)), original(self, name, dim, slices))[1])
    source = InitTensors(spec, None)
    weights = dict(reference.named_parameters(remove_duplicate=False))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(read_shard(source, PARAMETER, q, ShardSpec(0), 1, 2), weights[q][16:])
    assert reads[-1] == (q, 0, [slice(16, 32)])  # one slice read, not the tensor
    down = "model.layers.0.mlp.down_proj.weight"
    fused = read_shard(source, PARAMETER, down, ShardSpec(1, (32, 32)), 0, 2)  # per part, as fused projections
    assert torch.equal(fused, torch.cat([weights[down][:, :16], weights[down][:, 32:48]], dim=1))
    # the tied head is stored once, under the embedding's name, and read from there
    head = read_shard(source, PARAMETER, "lm_head.weight", ShardSpec(0), 0, 2)
    assert torch.equal(head, weights["model.embed_tokens.weight"][:128]) and reads[-1][0] == "model.embed_tokens.weight"
    # every tensor equals from_pretrained's; non-persistent buffers come from the model's own rule
    for name, value in weights.items():
        assert torch.equal(source.full(PARAMETER, name), value), name
    for name, value in reference.named_buffers():
        assert torch.allclose(source.full(BUFFER, name), value), name
    assert source.whole_builds == 0


def test_a_sharded_checkpoint_reads_each_tensor_from_its_file(tmp_path, checkpoint):
    from mist_compiler.ir.model_graph import PARAMETER
    from mist_compiler.lowering.materialize import InitTensors

    spec = save_tiny_llama(str(tmp_path / "sharded"), max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    source = InitTensors(spec, None)
    assert len({path for path, _ in ((c.files[n], n) for c, n in source.stored.values())}) > 1
    for name, value in checkpoint[2].named_parameters(remove_duplicate=False):
        assert torch.equal(source.full(PARAMETER, name), value), name


def test_a_factory_calling_from_pretrained_is_captured_without_loading(checkpoint, monkeypatch):
    """Capture and the ranks' meta build read no weight (from_pretrained builds from the config there);
    the ranks then read the checkpoint; a weight the factory changed after loading is the factory's."""
    from mist_compiler.frontend.capture import capture
    from mist_compiler.ir.model_graph import PARAMETER
    from mist_compiler.lowering.materialize import InitTensors

    folder, _, reference = checkpoint
    monkeypatch.setenv("MIST_TEST_CHECKPOINT", folder)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded during a virtual build")

    with monkeypatch.context() as patch:
        patch.setattr(transformers.PreTrainedModel, "_load_pretrained_model", staticmethod(no_loading))
        program = capture("tests.pretrained_models:loaded", dtype="float32", analyse=False)
        source = InitTensors("tests.pretrained_models:loaded", None)
    assert program.model_graph.num_layers == 2
    weights = dict(reference.named_parameters(remove_duplicate=False))
    assert all(torch.equal(source.full(PARAMETER, name), value) for name, value in weights.items())
    assert source.whole_builds == 0
    edited = InitTensors("tests.pretrained_models:loaded_then_edited", None)
    assert "model.norm.weight" not in edited.stored
    assert torch.equal(edited.full(PARAMETER, "model.norm.weight"), 2 * weights["model.norm.weight"])


def test_the_ir_of_a_from_pretrained_factory_prints_without_a_traceback(checkpoint):
    result = _mistc("ir", "tests.pretrained_models:loaded", env={"MIST_TEST_CHECKPOINT": checkpoint[0]})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "class 1 (layer)" in result.stdout


def test_what_hf_means_is_never_guessed(checkpoint, tmp_path):
    """hf:DIR/config.json next to weights is ambiguous; hf:DIR without weights, pickled weights and
    a folder without config are refused: one line each, naming the way out."""
    folder = checkpoint[0]
    ambiguous = _mistc("ir", f"hf:{folder}/config.json")
    assert ambiguous.returncode == 2 and "ambiguous" in ambiguous.stderr and f"hf:{folder}" in ambiguous.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    no_weights = _mistc("ir", f"hf:{bare}")
    assert no_weights.returncode == 2 and f"hf:{bare}/config.json" in no_weights.stderr
    (bare / "pytorch_model.bin").write_bytes(b"not read")
    pickled = _mistc("ir", f"hf:{bare}")
    assert pickled.returncode == 2 and "pickled" in pickled.stderr
    for result in (ambiguous, no_weights, pickled):
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    random_config = _mistc("ir", f"hf:{tmp_path}/bare/config.json")  # pickled weights next to it: ambiguous too
    assert random_config.returncode == 2 and "ambiguous" in random_config.stderr


@pytest.mark.heavy
@pytest.mark.distributed
@pytest.mark.parametrize("stages,grad_accum", [
    ([{"layers": [0, 2], "gpus_per_node": 2, "micro_batch": 4, "tp": 2}], 1),  # every rank reads its slices
    ([{"layers": [0, 1], "gpus_per_node": 1, "micro_batch": 2, "tp": 1},
      {"layers": [1, 2], "gpus_per_node": 1, "micro_batch": 2, "tp": 1}], 2),  # the head tied across stages
], ids=["tp2", "pp2"])
def test_mistc_run_checks_a_pretrained_model_under_a_plan(checkpoint, tmp_path, stages, grad_accum):
    import json

    folder, spec, _ = checkpoint
    plan = {"model": spec, "seq_len": 16, "global_batch": 4, "dtype": "float32", "grad_accum": grad_accum,
            "stages": [{"nodes": 1, "dp": 1, "zero": 0, **stage} for stage in stages]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = _mistc("run", spec, "--plan", str(tmp_path / "plan.json"), "--nproc-per-node", "2", "--steps", "2",
                    "--check")
    assert result.returncode == 0 and "check: OK" in result.stdout, (result.stdout + result.stderr)[-3000:]
