"""The per-rank program ``mistc train`` launches through torchrun: ``--config FILE`` (written by the
launcher: model, plan, :class:`.trainer.TrainConfig`) -> :class:`.trainer.Trainer` ``.fit()``.
Errors and teardown are those of every launched rank (:func:`mist_compiler.launch.worker.run_rank`);
SIGTERM/SIGINT are recorded from the start (:mod:`.preemption`), so a preempted rank finishes its
step, saves and exits with ``exit_codes.PREEMPTED`` (75), saying so in one line (rank 0).
"""
from __future__ import annotations

import argparse
import json
import sys


def _train(spec: dict, rank: int, stop) -> int:
    from ..launch.exit_codes import INTERRUPTED, OK, PREEMPTED
    from ..launch.worker import say
    from .preemption import Preempted
    from .trainer import TrainConfig, Trainer

    trainer = Trainer(spec["model"], spec["plan"], TrainConfig.from_dict(spec["train"]))
    try:
        trainer.fit(stop)
    except Preempted as preempted:
        if rank == 0:
            say(str(preempted) if preempted.checkpoint else f"stopped by {preempted.signal_name} after step "
                f"{preempted.step}; nothing saved (no --save-dir)")
        return PREEMPTED if preempted.checkpoint else INTERRUPTED
    finally:
        trainer.close()
    return OK


def main(argv: list[str] | None = None) -> int:
    from ..launch.worker import run_rank
    from .preemption import StopRequest

    parser = argparse.ArgumentParser(prog="mist_compiler.training.worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    with open(args.config) as handle:
        spec = json.load(handle)
    stop = StopRequest()  # installed inside run_rank, after its own defaults
    options = {"model": spec["model"], "plan": spec["plan"], **spec["train"]}
    return run_rank(lambda rank: _train(spec, rank, stop.install()), timeout=args.timeout, debug=args.debug,
                    options=options)


if __name__ == "__main__":
    sys.exit(main())
