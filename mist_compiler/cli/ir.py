"""Capture a model and print its Mist IR: blocks, block classes, symbolic shapes, saved bytes.

MODEL is a zoo name (gpt2-7b, llama-70b, gpt-tiny ...), hf:DIR (a save_pretrained directory),
hf:path/to/config.json or package.module:function. --json prints a machine-readable summary (add
--full for every IR node).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..ir.vocabulary import ATTENTION_KERNELS
from ..ir.vocabulary import DEFAULT_DTYPE
from ..ir.vocabulary import TRAINING_DTYPES as DTYPE_CHOICES

CAPTURE_PASSES = ("build_fake_model", "group_layers", "keep_one_layer_per_group", "cast_weights", "check_model_output",
                  "check_layer_chain", "trace_joint_graph", "find_model_graph", "recognise_tensor_parallel",
                  "shape_prop", "block_discovery", "lower_to_ir")
# The plan-driven lowering passes of the backend (lowering/lower.py); they need --plan.
LOWERING_PASSES = ("partition", "tp_sharding", "loss_kernel", "checkpoint", "offload_insertion")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name, hf:DIR, hf:path/to/config.json or package.module:function")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--full", action="store_true", help="with --json: include the whole IR (every node)")
    parser.add_argument("--nodes", action="store_true", help="text: list every forward/backward IR node")
    parser.add_argument("--micro-batch", type=int, default=1, help="b at which saved bytes are evaluated (default 1)")
    parser.add_argument("--seq", type=int, default=None,
                        help="s at which saved bytes are evaluated (default: the model's max sequence, else 2048)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=DEFAULT_DTYPE,
                        help=f"weight/activation dtype (default {DEFAULT_DTYPE}, as mistc tune)")
    parser.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash",
                        help="target attention kernel: decides what attention saves (default flash)")
    parser.add_argument("--plan", help="plan file: with --after LOWERING_PASS, dump each stage's program after that pass")
    parser.add_argument("--after", action="append", default=[], metavar="PASS", choices=CAPTURE_PASSES + LOWERING_PASSES,
                        help="also print the state after this pass (repeatable); capture passes: "
                             f"{', '.join(CAPTURE_PASSES)}; lowering passes (need --plan): {', '.join(LOWERING_PASSES)}")


def summary(program, micro_batch: int, seq: int, attention: str) -> dict:
    """The ``--json`` document: totals, one entry per block, saved bytes per block class."""
    from ..ir.program import expr_str

    classes = []
    for cls in program.block_classes.values():
        expr = cls.saved_bytes_expr(attention)
        classes.append({
            "class_id": cls.class_id, "kind": cls.kind, "structural_hash": cls.structural_hash,
            "representative": cls.representative, "params": cls.param_count,
            "blocks": [b.index for b in program.blocks if b.class_id == cls.class_id],
            "forward_ops": len(cls.forward_nodes), "backward_ops": len(cls.backward_nodes),
            "saved_bytes": program.saved_bytes(cls.class_id, micro_batch, seq, attention),
            "saved_bytes_expr": str(expr_str(expr)),
        })
    return {
        "model": program.model_name, "dtype": program.dtype, "attention": attention,
        "micro_batch": micro_batch, "seq": seq, "params": program.params,
        "layers": len(program.layers), "block_classes": len(program.block_classes),
        "blocks": [{"index": b.index, "kind": b.kind, "module_path": b.module_path, "class_id": b.class_id,
                    "params": b.param_count} for b in program.blocks],
        "classes": classes,
    }


def run(args: argparse.Namespace) -> int:
    from ..frontend.capture import capture
    from ..ir.printer import format_program

    from ..ir.plan import MAX_INT

    if not 1 <= args.micro_batch <= MAX_INT:
        raise ValueError(f"--micro-batch must be in 1..{MAX_INT}, got {args.micro_batch}")
    if args.seq is not None and not 1 <= args.seq <= MAX_INT:
        raise ValueError(f"--seq must be in 1..{MAX_INT}, got {args.seq}")

    lowering_after = [name for name in args.after if name in LOWERING_PASSES]
    if lowering_after and not args.plan:
        raise ValueError(f"--after {lowering_after[0]} is a lowering pass: it needs --plan PLAN")
    if args.plan:
        from ..driver import check_plan
        from ..ir.plan import load_plan
        from ..lowering.lower import dump_lowered

        plan = load_plan(args.plan)
        program = capture(args.model, dtype=plan.dtype, attention=args.attention, seq_len=plan.seq_len, analyse=False)
        check_plan(program, plan, model_name=args.model, prove=False)
        for name in lowering_after or ["offload_insertion"]:
            print(dump_lowered(program, plan, name))
        return 0

    def dump(name: str, state) -> None:
        print(f"=== after {name} ===\n{state}\n", file=sys.stderr if args.json else sys.stdout)

    program = capture(args.model, dtype=args.dtype, attention=args.attention, print_after=args.after, on_dump=dump)
    seq = args.seq or program.seq_len
    from ..driver import check_sequence

    check_sequence(program, seq)
    if args.json:
        document = summary(program, args.micro_batch, seq, args.attention)
        if args.full:
            document["program"] = program.to_json()
        print(json.dumps(document, indent=2))
    else:
        print(format_program(program, nodes=args.nodes))
        print(f"\nsaved for backward at b={args.micro_batch}, s={seq} ({args.attention} attention):")
        for cls in program.block_classes.values():
            saved = program.saved_bytes(cls.class_id, args.micro_batch, seq, args.attention)
            print(f"  class {cls.class_id} ({cls.kind}): {saved:,} bytes ({saved / 2**20:.1f} MiB)")
    return 0
