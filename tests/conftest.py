"""Shared fixtures: captures of the tiny zoo models (once per session) and tiny Hugging Face configs,
and the machine's share between pytest-xdist workers (tests marked ``exclusive`` run alone)."""
from __future__ import annotations

import fcntl
import os

import pytest

# The suite runs units eagerly unless a test asks for compiled ones (tests/test_compiled_units.py):
# inductor's first compile of a graph takes tens of seconds on this CPU. Ranks and `mistc` subprocesses
# inherit the setting.
os.environ.setdefault("MIST_COMPILE", "0")


def _start_the_cpu_thread_team() -> None:
    """A fresh process's first parallel CPU kernels can split their reductions differently from every
    later call (OpenMP's team starting up: a 6-layer MLP's first backward differed from its second in 5
    of 30 fresh processes with 2 threads, never with 1 or after this warm-up, in 40). Tests that compare
    two runs of one process bit for bit (tests/test_offload_overlap.py) need that first call out of the way."""
    import torch

    weight = torch.randn(64, 64, requires_grad=True)
    (torch.randn(16, 64) @ weight).tanh().sum().backward()


_start_the_cpu_thread_team()


@pytest.fixture(scope="session")
def gpt_tiny_program():
    from mist_compiler.frontend.capture import capture

    return capture("gpt-tiny")


@pytest.fixture(scope="session")
def llama_tiny_program():
    from mist_compiler.frontend.capture import capture

    return capture("llama-tiny")


def tiny_hf_config(kind: str):
    """A 2-layer Hugging Face GPT-2 or Llama config (no dropout, SDPA attention)."""
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
    else:
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "sdpa"
    return config


@pytest.fixture
def hf_config_path(tmp_path):
    """Write a tiny HF config to ``tmp_path/<kind>/config.json``; returns (path, config)."""

    def write(kind: str):
        config = tiny_hf_config(kind)
        folder = tmp_path / kind
        folder.mkdir()
        config.save_pretrained(str(folder))
        return os.path.join(str(folder), "config.json"), config

    return write


@pytest.fixture(autouse=True)
def _machine_share(request, tmp_path_factory):
    """Under pytest-xdist (the README's test command runs two workers), a test marked ``exclusive``
    (one whose assertions read wall time or thread overlap) waits until no other worker runs a test and
    keeps the others out while it runs; the rest share the machine. Two flocks: every test passes the
    turnstile to take the room (shared, or alone), so a waiting exclusive test is not starved by the
    other worker taking the room again. A worker that dies releases its locks with its files."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = request.node.get_closest_marker("exclusive") is not None
    run = tmp_path_factory.getbasetemp().parent  # each worker's base is popen-gwN in the run's own (pytest keeps 3)
    with open(run / "mist-turnstile.lock", "a+") as turnstile, open(run / "mist-room.lock", "a+") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
