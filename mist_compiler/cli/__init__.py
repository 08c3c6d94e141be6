"""``mistc``: the command line, a thin layer over the Python API.

Each sub-command is a module of this package with ``add_arguments(parser)`` and
``run(args) -> int``; this file only names them. The top layer: may import anything.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "ir": ("mist_compiler.cli.ir", "capture a model and print its Mist IR"),
    "analyze": ("mist_compiler.cli.analyze", "predict time and memory of a plan"),
    "profile": ("mist_compiler.cli.profile", "measure this machine into a hardware profile"),
    "tune": ("mist_compiler.cli.tune", "search the fastest plan for a model and cluster"),
    "explain": ("mist_compiler.cli.explain", "describe a plan: words, breakdown, timeline"),
    "run": ("mist_compiler.cli.run", "train a model with a plan through torchrun"),
    "train": ("mist_compiler.cli.train", "train for real: data, schedule, clipping, checkpoints"),
    "demo": ("mist_compiler.cli.demo", "tune the built-in default and train it on 2 local processes"),
}


def _chosen_command(argv: list[str]) -> str | None:
    return next((token for token in argv if not token.startswith("-")), None)


class _Parser(argparse.ArgumentParser):
    """Bad arguments end in one line naming the option (the usage text is what --help is for)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The top-level parser; only the chosen command's module is imported (keeps --help fast)."""
    parser = _Parser(prog="mistc", description="mist-compiler: automatic distributed training for LLMs")
    parser.add_argument("--debug", action="store_true", help="show full Python tracebacks on errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _chosen_command(argv)
    for name, (module_name, help_text) in COMMANDS.items():
        if name != chosen:
            commands.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        sub = commands.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        print("mistc: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as error:
        # Errors of ours carry a message that names the field or constraint; show it plainly.
        if getattr(args, "debug", False):
            raise
        print(f"mistc {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
