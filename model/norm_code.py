"""A saved model carries the code of its norms that NormLab does not define, as transformers' custom-code saving
carries the model's own files: the module of each such class is copied beside norms.py in the saved folder, and
the folder's saved_norms.py imports it and registers the names the config uses. A module can travel when what it
imports will be wherever the folder is loaded: the standard library, installed distributions, and NormLab's norm
API as `from model.norms import ...` (rewritten to the folder's own copy, `from .norms import ...`). A module that
imports its own package, other local code or normlab, or a class defined in `__main__` or inside a function,
cannot: `check_norm_code` refuses it in one line, before anything is written. docs/model.md, "A norm of your own".
"""

import ast
import functools
import importlib.metadata
import inspect
import re
import sys
from pathlib import Path

from . import norms

PACKAGE = "model"  # NormLab's model package, as a user's module imports it (pyproject.toml)
SAVED_NORMS_FILE = "saved_norms.py"
SAVED_NORMS_HEADER = """The norms this model's config uses that NormLab's norms.py does not define, written when the
model was saved (NormLab's model/norm_code.py): their modules are saved beside this file, and importing it (as
configuration_normlab.py does) registers them.
"""


def carried_norms(config) -> list[tuple[str, type, dict]]:
    """(name, class, preset) of each norm the config uses that norms.py does not define, in the config's order."""
    names = dict.fromkeys(config.norms_used())
    return [(n, norms.norm_class(n), norms.NORM_PRESETS[n]) for n in names if n not in norms.BUILTIN_NORMS]


@functools.cache
def _carried_files() -> frozenset[str]:
    """The model files a saved folder holds that a norm's module may import: norms.py and what it imports."""
    from transformers.dynamic_module_utils import get_relative_import_files

    return frozenset(["norms", *(Path(f).stem for f in get_relative_import_files(norms.__file__))])


@functools.cache
def _distributions() -> dict:
    return importlib.metadata.packages_distributions()  # top-level import name -> the installed distributions


def _installed(top: str) -> bool:
    return top in sys.stdlib_module_names or top in _distributions()


def _beside_norms(module) -> bool:
    """A module of norms.py's own package: a saved folder's copy (a loaded model saved again)."""
    return module.__name__.rpartition(".")[0] == norms.__name__.rpartition(".")[0]


def _import_problem(node, module) -> str | None:
    """Why an import statement of `module` would fail where the saved folder is loaded, or None."""
    own = module.__name__.split(".")[0]
    if isinstance(node, ast.ImportFrom) and node.level > 0:
        if _beside_norms(module) and node.level == 1 and node.module in _carried_files():
            return None
        return f"imports .{node.module or ''} relatively, and only the module's own file travels"
    tops = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
    for target in tops:
        parts = target.split(".")
        if parts[0] == PACKAGE:
            if isinstance(node, ast.ImportFrom) and len(parts) == 2 and parts[1] in _carried_files():
                continue
            return f"imports {target} as `{ast.unparse(node)}`; write `from model.norms import ...`"
        if parts[0] == "normlab":
            return "imports normlab, which a saved model's code must not need"
        if parts[0] == own and not _beside_norms(module):
            return f"imports its own package {own}, which does not travel with the model"
        if not _installed(parts[0]):
            return f"imports {parts[0]}, which is neither the standard library nor an installed distribution"
    return None


def _class_problem(cls, preset: dict) -> str | None:
    """Why the class's module cannot travel, or None."""
    if cls.__module__ == "__main__":
        return "it is defined in __main__ (a script or a notebook); move it into a module of its own"
    module = sys.modules.get(cls.__module__)
    if "<locals>" in cls.__qualname__ or getattr(module, cls.__qualname__, None) is not cls:
        return "it is not a top-level class of its module; define it at the top level of a module"
    bad = [k for k, v in preset.items() if not _is_literal(v)]
    if bad:
        return f"its preset argument {bad[0]}={preset[bad[0]]!r} is not a Python literal"
    if _norm_file(cls) is not None:
        return None  # one of NormLab's classes with other presets: the folder's copy of its file defines it
    source = inspect.getsourcefile(module) if module is not None else None
    if source is None or not source.endswith(".py"):
        return f"its module {cls.__module__} has no Python source file to copy"
    for node in ast.walk(ast.parse(Path(source).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import | ast.ImportFrom):
            problem = _import_problem(node, module)
            if problem:
                return f"its module {cls.__module__} {problem}"
    return None


def _is_literal(value) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError):
        return False


def check_norm_code(config) -> None:
    """ValueError, one line, when a norm the config uses cannot be saved with the model (module docstring)."""
    for name, cls, preset in carried_norms(config):
        problem = _class_problem(cls, preset)
        if problem:
            raise ValueError(f"norm {name!r} ({cls.__module__}.{cls.__qualname__}) cannot be saved with the model: "
                             f"{problem} (docs/model.md, 'A norm of your own')")


def _portable_source(module) -> str:
    """The module's source with `from model.X import` made relative (`from .X import`), as the folder holds X."""
    lines = Path(inspect.getsourcefile(module)).read_text(encoding="utf-8").splitlines(keepends=True)
    for node in ast.walk(ast.parse("".join(lines))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.startswith(PACKAGE + "."):
            line, col = lines[node.lineno - 1], node.col_offset
            lines[node.lineno - 1] = line[:col] + re.sub(rf"^from\s+{PACKAGE}\.", "from .", line[col:])
    return "".join(lines)


def _norm_file(cls) -> str | None:
    """The file (no .py) of NormLab's norm code that defines the class (norms.py or a file it imports, which every
    saved folder holds), or None for a class from elsewhere."""
    package, _, stem = cls.__module__.rpartition(".")
    own = package == norms.__name__.rpartition(".")[0] and stem in _carried_files()
    return stem if own else None


def _saved_as(cls) -> str:
    """The file name (no .py) the class's module has in a saved folder."""
    if _norm_file(cls) is not None:
        return _norm_file(cls)
    module = sys.modules[cls.__module__]
    return Path(module.__file__).stem if _beside_norms(module) else "norm_" + cls.__module__.replace(".", "_")


def save_norm_code(config, folder) -> list[str]:
    """Save the modules of the config's norms that norms.py does not define into `folder` and write its
    saved_norms.py; returns the files written (none when every norm is NormLab's). Call `check_norm_code` first."""
    entries = carried_norms(config)
    if not entries:
        return []
    folder, written, aliases = Path(folder), [], {}  # aliases: class -> its name in saved_norms.py
    for cls in dict.fromkeys(cls for _, cls, _ in entries):
        taken = set(aliases.values())
        aliases[cls] = cls.__qualname__ if cls.__qualname__ not in taken else f"{cls.__qualname__}_{len(taken)}"
        stem = _saved_as(cls)
        if _norm_file(cls) is None and f"{stem}.py" not in written:
            (folder / f"{stem}.py").write_text(_portable_source(sys.modules[cls.__module__]), encoding="utf-8")
            written.append(f"{stem}.py")
    imports = [f"from .{_saved_as(cls)} import {cls.__qualname__}" + (f" as {a}" if a != cls.__qualname__ else "")
               for cls, a in aliases.items()]
    registrations = [f"register_norm({aliases[cls]}, name={name!r}" + "".join(f", {k}={v!r}" for k, v in
                                                                              preset.items()) + ")"
                     for name, cls, preset in entries]
    names = tuple(name for name, _, _ in entries)
    text = (f'"""{SAVED_NORMS_HEADER}"""\n\nfrom .norms import register_norm\n' + "".join(f"{i}\n" for i in imports)
            + f"\nSAVED_NORMS = {names!r}\n\n" + "".join(f"{r}\n" for r in registrations))
    (folder / SAVED_NORMS_FILE).write_text(text, encoding="utf-8")
    return [*written, SAVED_NORMS_FILE]
