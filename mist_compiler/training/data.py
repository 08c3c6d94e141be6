"""Training data: a token file or a text file, sampled identically under every plan.

Accepted files (:func:`open_tokens`):

- ``*.bin``: raw little-endian token ids, memory-mapped (nanoGPT style). The dtype is uint16
  unless the name ends in ``.u32.bin`` / ``.uint32.bin`` (or ``dtype="uint32"`` is given);
  ``.u16.bin`` / ``.uint16.bin`` say uint16 explicitly.
- anything else: UTF-8 text, tokenised byte-level (ids 0..255), or with a Hugging Face tokenizer
  the user names (``tokenizer=``, needs ``transformers``; optional).

Sampling (:class:`TokenSampler`) depends only on the seed and the step: global batch ``i`` draws
``global_batch`` start offsets from a generator seeded with ``(seed, i)``; sequence ``j`` is
``tokens[o_j : o_j + seq]``; its labels follow the model's own convention
(:mod:`mist_compiler.frontend.labels`): the next tokens ``tokens[o_j + 1 : o_j + seq + 1]`` for a
model that takes shifted labels (the zoo), the inputs themselves for one that shifts inside (Hugging
Face causal LMs), so both minimise the same next-token loss. The engine then hands each data-parallel
rank and micro-batch its rows, so two plans with the same global batch see the same data, and a
resumed run needs only the step number. Nothing here unpickles anything.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .tokenizers import load_tokenizer

SAMPLE_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample.txt")
BYTE_VOCAB = 256


class DataError(ValueError):
    """Unusable training data; the message names the file and the reason."""


def _bin_dtype(path: str, dtype: str | None) -> np.dtype:
    name = path.lower()
    if dtype is None:
        dtype = "uint32" if name.endswith((".u32.bin", ".uint32.bin")) else "uint16"
    if dtype not in ("uint16", "uint32"):
        raise DataError(f"--data-dtype must be uint16 or uint32, got {dtype!r}")
    return np.dtype(dtype).newbyteorder("<")


def open_tokens(path: str, *, dtype: str | None = None, tokenizer: str | None = None) -> np.ndarray | torch.Tensor:
    """The file's tokens as a 1-D array (memory-mapped for ``.bin``)."""
    if not os.path.isfile(path):
        raise DataError(f"data file {path!r} does not exist")
    if path.lower().endswith(".bin"):
        np_dtype = _bin_dtype(path, dtype)
        size = os.path.getsize(path)
        if size % np_dtype.itemsize:
            raise DataError(f"data file {path!r}: {size} bytes is not a whole number of {np_dtype.name} tokens "
                            f"(wrong --data-dtype?)")
        if size == 0:
            raise DataError(f"data file {path!r} is empty")
        return np.memmap(path, dtype=np_dtype, mode="r")
    with open(path, "rb") as handle:
        raw = handle.read()
    if tokenizer is None:
        return np.frombuffer(raw, dtype=np.uint8)
    ids = load_tokenizer(tokenizer)(raw.decode("utf-8", errors="replace"))["input_ids"]
    return np.asarray(ids, dtype=np.int64)


def token_vocab(path: str, tokenizer: str | None) -> int | None:
    """The vocabulary a text file's tokeniser needs (None for token files: checked by value)."""
    if path.lower().endswith(".bin"):
        return None
    if tokenizer is None:
        return BYTE_VOCAB
    return len(load_tokenizer(tokenizer))


def check_token_width(tokens: np.ndarray, path: str, sample: int = 1 << 20) -> None:
    """Refuse a uint16 view of a file of uint32 tokens (little-endian ids below 65536: every odd uint16 is 0)."""
    if tokens.dtype.itemsize != 2 or len(tokens) < 64:
        return
    head = np.asarray(tokens[:min(len(tokens), sample) // 2 * 2])
    high, low = head[1::2], head[0::2]
    if np.count_nonzero(high) <= 0.01 * len(high) and np.count_nonzero(low) >= 0.5 * len(low):
        raise DataError(f"data {path!r} looks like uint32 tokens read as uint16 (every second uint16 is 0); "
                        f"pass --data-dtype uint32 or name the file *.u32.bin")


@dataclass
class TokenSampler:
    """Deterministic global batches of ``(input_ids, labels)`` from a token array."""

    tokens: np.ndarray
    global_batch: int
    seq_len: int
    seed: int = 0
    path: str = "<tokens>"
    vocab: int | None = None  # when set, every batch is checked against it (cheap; check_vocab reads the file)
    shift_labels: bool = True  # labels = the next tokens; False: labels = input_ids (the model shifts them)

    def __post_init__(self) -> None:
        self.span = len(self.tokens) - self.seq_len  # number of valid start offsets
        need = self.global_batch * self.seq_len + 1
        if len(self.tokens) < need:
            raise DataError(f"data {self.path!r} has {len(self.tokens)} tokens, fewer than one global batch "
                            f"({self.global_batch} x {self.seq_len} + 1 = {need})")

    def check_vocab(self, vocab: int) -> None:
        """Refuse token ids the model's embedding cannot take (one pass over the file), and uint32
        tokens read as uint16 (their high halves make every second id 0, all within the vocabulary)."""
        check_token_width(self.tokens, self.path)
        largest = int(np.max(self.tokens)) if len(self.tokens) else 0
        if largest >= vocab:
            raise DataError(f"data {self.path!r} holds token id {largest} but the model's vocabulary has {vocab} "
                            f"entries (wrong --data-dtype or tokenizer?)")

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """Global batch number ``step`` (0-based)."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.span, (self.global_batch,), generator=generator).tolist()
        window = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts])
        if self.vocab is not None and int(window.max()) >= self.vocab:
            raise DataError(f"data {self.path!r} holds token id {int(window.max())} but the model's vocabulary has "
                            f"{self.vocab} entries (wrong --data-dtype or tokenizer?)")
        window = torch.from_numpy(window)
        input_ids = window[:, :-1].contiguous()
        labels = window[:, 1:].contiguous() if self.shift_labels else input_ids.clone()
        return {"input_ids": input_ids, "labels": labels}
