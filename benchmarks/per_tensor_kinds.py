"""Per-tensor activation policies as ``gpu_check.py --extra-kinds``: solved here, where python-mip is.

A lent GPU image may lack python-mip's CBC wheel, so the MILP runs on this machine and the GPU run
trains what it chose. The layer's activation frontier (``tuner.activation_milp``, priced on the hardware
profile at micro-batch 1, as the tuner solves it) gives three policies for the one-device section:

- ``per-tensor: recompute only``: the cheapest recomputation-only policy at about half the layer's bytes;
- ``per-tensor: recompute + offload``: the offload frontier's point nearest half the layer's bytes;
- ``per-tensor: nothing kept``: the least memory, replaying the layer from its input, which goes to the
  host (a held value offloaded).

Usage: ``PYTHONPATH=. python benchmarks/per_tensor_kinds.py [--model gpt2-1.3b] [--hardware h200]
[--seq 2048] [--out benchmarks/plans/gpt2-per-tensor.json]``
"""
from __future__ import annotations

import argparse
import json


def policies(model: str, hardware: str, seq: int) -> dict[str, dict]:
    from mist_compiler import driver
    from mist_compiler.tuner.activation_milp import frontier

    program, cost_model = driver.price(model, hardware, seq_len=seq)
    rows, rates = cost_model.layer_rows(1, False)
    half = sum(row.saved for row in rows) / 2
    recompute = [s for s in frontier(rows, rates, offload=False) if s.kept <= half]
    both = frontier(rows, rates, offload=True, offload_held=True)
    chosen = {"per-tensor: recompute only": min(recompute, key=lambda s: s.seconds),
              "per-tensor: recompute + offload": min(both, key=lambda s: abs(s.kept - half)),
              "per-tensor: nothing kept": min(both, key=lambda s: (s.kept, s.seconds))}
    return {kind: {"activations": {"recompute": list(s.policy.recompute), "offload": dict(s.policy.offload)}}
            for kind, s in chosen.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-1.3b")
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", default="benchmarks/plans/gpt2-per-tensor.json")
    args = parser.parse_args(argv)
    kinds = policies(args.model, args.hardware, args.seq)
    with open(args.out, "w") as handle:
        json.dump(kinds, handle, indent=2)
        handle.write("\n")
    print(json.dumps(kinds, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
