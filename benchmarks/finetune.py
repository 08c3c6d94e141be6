"""Fine-tuning a pretrained model: mist against plain transformers + torch, held-out loss before and after.

1. A "pretrained" tiny Llama (byte-level vocabulary 256, hidden 64, 2 layers, tied head) is made
   offline: random weights trained briefly with plain torch on the first half of the bundled sample
   text, then ``save_pretrained`` (the user's starting point);
2. it is fine-tuned for 20 steps (global batch 8, sequence 64, AdamW with decay on non-embedding
   matrices, warm-up + cosine, clipping at 1.0) on the next part of the text:
   - ``mistc train hf:DIR --export DIR`` as a user types it (1 process, and 2 data-parallel ranks),
   - the user's own loop under ``torch.compile(model, backend="mist")`` (one process),
   - plain transformers + torch: the same batches and the same recipe, eagerly;
3. every result is read back with ``from_pretrained`` (mist's exports) and scored on the last tenth
   of the text, which no run trains on: the model's own mean next-token loss.

The runs must agree within rounding (the table shows the largest relative weight difference to the
plain-torch result) and the held-out loss must fall.

Usage: ``PYTHONPATH=. python benchmarks/finetune.py [--steps 20] [--out benchmarks/results/finetune-cpu.md]``
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from mist_compiler.training.data import SAMPLE_TEXT, TokenSampler, open_tokens  # noqa: E402
from mist_compiler.training.optim import LRSchedule, decays  # noqa: E402

GLOBAL_BATCH, SEQ = 8, 64
LR, MIN_LR, WARMUP, WEIGHT_DECAY, CLIP, BETAS = 1e-3, 1e-4, 2, 0.1, 1.0, (0.9, 0.95)


def make_pretrained(folder: str, text: bytes) -> None:
    """A tiny Llama trained briefly on ``text`` with plain torch, saved with save_pretrained."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        starts = torch.randint(0, len(tokens) - SEQ, (16,), generator=generator)
        ids = torch.stack([tokens[s:s + SEQ] for s in starts.tolist()])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(folder)


def held_out_loss(model, tokens: torch.Tensor) -> float:
    windows = tokens[: len(tokens) // SEQ * SEQ].view(-1, SEQ)
    with torch.no_grad():
        return float(model(input_ids=windows, labels=windows).loss)


def recipe(model, steps: int) -> tuple[torch.optim.Optimizer, LRSchedule]:
    """mistc train's recipe as a torch optimizer: decay on non-embedding matrices only."""
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n, tuple(p.shape))], "weight_decay": WEIGHT_DECAY},
              {"params": [p for n, p in named if not decays(n, tuple(p.shape))], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=1e-8), LRSchedule(LR, steps, WARMUP, MIN_LR)


def eager_loop(folder: str, data: str, steps: int, backend: str | None) -> tuple[object, list[float], float]:
    """The user's loop: plain transformers + torch, or the same loop through torch.compile(backend=...)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    model.train()
    run = model if backend is None else torch.compile(model, backend=backend, options={
        "hardware": "cpu", "global_batch": GLOBAL_BATCH, "seq_len": SEQ})
    opt, schedule = recipe(model, steps)
    sampler = TokenSampler(open_tokens(data), GLOBAL_BATCH, SEQ, 0, shift_labels=False)
    losses, started = [], time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = schedule(step + 1)
        loss = run(**sampler.batch(step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, losses, time.perf_counter() - started


def mistc_train(spec: str, data: str, steps: int, ranks: int, work: str) -> tuple[object, list[float], float]:
    import transformers

    out, metrics = os.path.join(work, f"tuned-{ranks}"), os.path.join(work, f"metrics-{ranks}.jsonl")
    command = [os.path.join(os.path.dirname(sys.executable), "mistc"), "train", spec, "--data", data,
               "--steps", str(steps), "--lr", str(LR), "--min-lr", str(MIN_LR), "--warmup", str(WARMUP),
               "--weight-decay", str(WEIGHT_DECAY), "--clip", str(CLIP), "--nproc-per-node", str(ranks),
               "--metrics", metrics, "--export", out, "--log-every", str(steps)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"mistc train failed:\n{result.stderr[-3000:]}")
    losses = [json.loads(line)["loss"] for line in open(metrics)]
    return transformers.AutoModelForCausalLM.from_pretrained(out), losses, wall


def weight_difference(model, reference) -> float:
    mine, theirs = model.state_dict(), reference.state_dict()
    return max(float((mine[k].double() - theirs[k].double()).norm() / theirs[k].double().norm().clamp(min=1e-30))
               for k in theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    import transformers

    text = open(SAMPLE_TEXT, "rb").read()
    half, held = len(text) // 2, len(text) * 9 // 10
    with tempfile.TemporaryDirectory() as work:
        base = os.path.join(work, "base")
        make_pretrained(base, text[:half])
        data = os.path.join(work, "finetune.txt")
        with open(data, "wb") as handle:
            handle.write(text[half:held])
        held_out = torch.frombuffer(bytearray(text[held:]), dtype=torch.uint8).long()
        before = held_out_loss(transformers.AutoModelForCausalLM.from_pretrained(base), held_out)

        reference, ref_losses, ref_wall = eager_loop(base, data, args.steps, None)
        runs = {"plain transformers + torch (eager)": (reference, ref_losses, ref_wall)}
        runs["mistc train hf:DIR, 1 process"] = mistc_train(f"hf:{base}", data, args.steps, 1, work)
        runs["mistc train hf:DIR, 2 ranks (dp 2)"] = mistc_train(f"hf:{base}", data, args.steps, 2, work)
        runs['torch.compile(backend="mist"), user loop'] = eager_loop(base, data, args.steps, "mist")

    lines = [f"Fine-tune of a pretrained tiny Llama ({args.steps} steps, global batch {GLOBAL_BATCH} x {SEQ} tokens, "
             f"{torch.__version__}, {os.cpu_count()} CPUs): held-out next-token loss before: {before:.4f}",
             "",
             "| run | train loss step 1 | train loss last step | held-out loss after | held-out change | "
             "max rel. weight diff vs eager | wall (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, (model, losses, wall) in runs.items():
        after = held_out_loss(model, held_out)
        lines.append(f"| {name} | {losses[0]:.5f} | {losses[-1]:.5f} | {after:.5f} | {after - before:+.4f} | "
                     f"{weight_difference(model, reference):.1e} | {wall:.1f} |")
    lines += ["", "mistc train's wall time includes launching, capturing and compiling (a fresh process each); the "
              "eager loops' only the 20 steps (plus, for torch.compile, tuning and compiling)."]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(f"# Fine-tune: mist against plain transformers + torch\n\n"
                         f"`PYTHONPATH=. python benchmarks/finetune.py --out {args.out}`\n\n{table}\n")


if __name__ == "__main__":
    main()
