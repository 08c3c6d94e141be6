"""A small pass manager: runs a list of passes in order, checking invariants between them.

A pass is any callable ``pass_(program) -> PassResult`` (or a bare program, taken as changed).
Passes are pure: they return a new program or the same object unchanged; they never mutate
their input in place. ``print_after`` names passes whose output is dumped (as compilers'
``-print-after`` options do), so ``mistc ir --after NAME`` can show the IR at any point.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass
class PassResult:
    program: Any
    modified: bool = True


def pass_name(pass_: Callable) -> str:
    return getattr(pass_, "name", None) or getattr(pass_, "__name__", None) or type(pass_).__name__


class PassError(RuntimeError):
    """A pass failed or broke an invariant; the message names the pass."""


@dataclass
class PassManager:
    passes: Sequence[Callable[[Any], Any]]
    invariants: Sequence[Callable[[Any], None]] = ()
    print_after: Sequence[str] = ()
    on_dump: Callable[[str, Any], None] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [pass_name(p) for p in self.passes]

    def __call__(self, program: Any) -> PassResult:
        unknown = sorted(set(self.print_after) - set(self.names()))
        if unknown:
            raise PassError(f"unknown pass name(s) {unknown}; passes are: {', '.join(self.names())}")
        any_modified = False
        for pass_ in self.passes:
            name = pass_name(pass_)
            start = time.perf_counter()
            result = pass_(program)
            if not isinstance(result, PassResult):
                result = PassResult(result, True)
            self.timings[name] = time.perf_counter() - start
            program = result.program
            any_modified |= result.modified
            for check in self.invariants:
                try:
                    check(program)
                except Exception as error:
                    raise PassError(f"invariant {pass_name(check)} fails after pass {name}: {error}") from error
            if name in self.print_after and self.on_dump is not None:
                self.on_dump(name, program)
        return PassResult(program, any_modified)
