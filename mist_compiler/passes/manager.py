"""A small pass manager: runs a list of typed passes in order, checking invariants between them.

A pass is a callable ``pass_(program) -> PassResult`` (or a bare program, taken as changed) that
declares the one type it takes and the one it returns: a class with ``input_type`` and
``output_type`` attributes, or a function marked with :func:`transforms`. The manager refuses a
list whose types do not chain (``A -> B`` followed by ``B -> C``) when it is built, and a pass
that returns something other than what it declared when it runs. Passes are pure: they return a
new program or the same object unchanged; they never mutate their input in place.
``invariants`` are checks run after every pass; ``print_after`` names passes whose output is
dumped (as compilers' ``-print-after`` options do), so ``mistc ir --after NAME`` can show the IR
at any point.

The three pass lists of the compiler: capture (``CaptureState -> CaptureState``, in
``frontend/capture.py``), analysis (``MistProgram -> MistProgram``, in ``cost/analysis.py``) and
lowering (``ModelGraph -> StageGraph -> StageGraph``, in ``lowering/lower.py``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

Program = TypeVar("Program")


@dataclass
class PassResult(Generic[Program]):
    program: Program
    modified: bool = True


def transforms(input_type: type, output_type: type | None = None) -> Callable[[Callable], Callable]:
    """Mark a function as a pass from ``input_type`` to ``output_type`` (default: the same type)."""
    def mark(function: Callable) -> Callable:
        function.input_type = input_type
        function.output_type = output_type or input_type
        return function
    return mark


def pass_name(pass_: Callable) -> str:
    return getattr(pass_, "name", None) or getattr(pass_, "__name__", None) or type(pass_).__name__


def pass_types(pass_: Callable) -> tuple[type, type]:
    """The declared (input, output) types of a pass."""
    types = (getattr(pass_, "input_type", None), getattr(pass_, "output_type", None))
    if types[0] is None or types[1] is None:
        raise PassError(f"pass {pass_name(pass_)} does not declare the type it takes and returns "
                        "(input_type/output_type, or @transforms)")
    return types


class PassError(RuntimeError):
    """A pass failed, broke an invariant or returned another type; the message names the pass."""


@dataclass
class PassManager(Generic[Program]):
    passes: Sequence[Callable[[Any], Any]]
    invariants: Sequence[Callable[[Any], None]] = ()
    print_after: Sequence[str] = ()
    on_dump: Callable[[str, Any], None] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for before, after in zip(self.passes, self.passes[1:]):
            if not issubclass(pass_types(before)[1], pass_types(after)[0]):
                raise PassError(f"pass {pass_name(after)} takes {pass_types(after)[0].__name__} but the pass before "
                                f"it, {pass_name(before)}, returns {pass_types(before)[1].__name__}")
        unknown = sorted(set(self.print_after) - set(self.names()))
        if unknown:
            raise PassError(f"unknown pass name(s) {unknown}; passes are: {', '.join(self.names())}")

    def names(self) -> list[str]:
        return [pass_name(p) for p in self.passes]

    def __call__(self, program: Program) -> PassResult:
        any_modified = False
        for pass_ in self.passes:
            name = pass_name(pass_)
            takes, returns = pass_types(pass_)
            if not isinstance(program, takes):
                raise PassError(f"pass {name} takes {takes.__name__}, got {type(program).__name__}")
            start = time.perf_counter()
            result = pass_(program)
            if not isinstance(result, PassResult):
                result = PassResult(result, True)
            self.timings[name] = time.perf_counter() - start
            if not isinstance(result.program, returns):
                raise PassError(f"pass {name} declares {returns.__name__} but returned {type(result.program).__name__}")
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
