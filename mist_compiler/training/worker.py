"""The per-rank program ``mistc train`` launches through torchrun: ``--config FILE`` (written by the
launcher: model, plan path, :class:`.trainer.TrainConfig`) -> :class:`.trainer.Trainer` ``.fit()``.
Errors and teardown are those of every launched rank (:func:`mist_compiler.launch.worker.run_rank`)."""
from __future__ import annotations

import argparse
import json
import sys


def _train(config_path: str, rank: int) -> int:
    from .trainer import TrainConfig, Trainer

    with open(config_path) as handle:
        spec = json.load(handle)
    trainer = Trainer(spec["model"], spec["plan"], TrainConfig.from_dict(spec["train"]))
    try:
        trainer.fit()
    finally:
        trainer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    from ..launch.worker import run_rank

    parser = argparse.ArgumentParser(prog="mist_compiler.training.worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    return run_rank(lambda rank: _train(args.config, rank), timeout=args.timeout, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
