"""The measure registry: the per-run outcomes a hypothesis may read, by name. Three are built in (exit, accuracy,
loss); a study's hook file (its `hooks:`, Python) adds its own with @measure. One name means one function: a name
taken by another function is refused, so two hook files can never silently swap a study's outcome."""

import importlib.util
import sys

from normlab.errors import StudyError
from normlab.study import outcomes as oc

# {outcome: the logged evaluation whose ranking the horizon rule reads}: the outcomes read from the final model,
# which the horizon rule guards
AT_END = {"accuracy": "accuracy", "loss": "loss"}
MEASURES = {}  # {name: fn(run: RunRecord, study) -> float}
REGISTERED = []  # every registration's name in order: a hook file registered what its loading appended


def _same(fn, other) -> bool:
    """The same definition (its code and what it closes over), wherever it was loaded from: a hook file executed
    again, or its copy in a study folder, registers its measures again."""
    cells = [[c.cell_contents for c in f.__closure__ or ()] for f in (fn, other)]
    return fn.__code__ == other.__code__ and cells[0] == cells[1]


def _where(fn) -> str:
    return f"{fn.__code__.co_filename}:{fn.__code__.co_firstlineno}"


def measure(name: str, at_end: str | None = None):
    """Register `fn(run: RunRecord, study) -> float` as the outcome `name` (a study's hook file uses this).
    `at_end`: the outcome is read from the final model like that logged evaluation (accuracy, loss), e.g. the
    accuracy on a subset of the documents, so the horizon rule guards it too, reading that evaluation's ranking."""
    def register(fn):
        old = MEASURES.get(name)
        if old is not None and not _same(fn, old):
            raise StudyError(f"measure {name!r} ({_where(fn)}) is already registered by another function "
                             f"({_where(old)}); give yours another name")
        MEASURES[name] = fn
        REGISTERED.append(name)
        if at_end is not None:
            AT_END[name] = at_end
        return fn
    return register


measure("exit")(lambda run, study: oc.exit_or_end(run))
measure("accuracy")(lambda run, study: run.score("accuracy"))
measure("loss")(lambda run, study: run.score("loss"))
BUILT_IN = tuple(MEASURES)


def load_hooks(path) -> set[str]:
    """A study's hook file: Python that registers its measures with @measure (at most one file per study); the
    names it registered (so that a study is checked against its own measures, not whatever else this process
    loaded before)."""
    start = len(REGISTERED)
    module = importlib.util.spec_from_file_location(f"study_hooks_{abs(hash(str(path)))}", path)
    # no __pycache__ beside it: the file may be a records folder's copy, which holds the records and nothing else
    writes, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        module.loader.exec_module(importlib.util.module_from_spec(module))
    finally:
        sys.dont_write_bytecode = writes
    return set(REGISTERED[start:])
