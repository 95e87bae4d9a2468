"""Imports point down: the data and write helpers do not import the config (and through it model/ and the
kernels), the run config reads the kernel mode names without importing the kernel package, and no two of
NormLab's modules import each other, however indirectly."""

import ast
import json
import os
import subprocess
import sys

from normlab.paths import REPO_ROOT

LOADED = "import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"


def modules_after(module: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `module` from this checkout."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", LOADED.format(module=module)], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def test_data_and_writes_import_neither_the_config_nor_the_model_nor_the_kernels():
    loaded = modules_after("normlab.data.sources, normlab.files.writes")
    assert "normlab.files.writes" in loaded  # the check itself works
    assert not {m.split(".")[0] for m in loaded} & {"model", "torch", "transformers", "omegaconf"}
    assert "normlab.kernels" not in loaded


def test_the_run_config_does_not_import_the_kernels():
    loaded = modules_after("normlab.config.loader")
    assert "model" in loaded and "normlab.kernels" not in loaded  # full module names


def _imports(path, name: str, known: set[str]) -> set[str]:
    """The NormLab modules `path` (module `name`) imports, at its top or inside a function, absolute or relative."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            # `from . import norms` imports the module model.norms; `from .norms import X` the module model.norms
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return (found & known) - {name}


def test_no_import_cycle_among_normlab_modules():
    """A cycle is two rooms that each need the other; an import inside a function hides it from the interpreter,
    not from this walk over every module of model/ and normlab/."""
    paths = {".".join(p.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for top in ("model", "normlab") for p in (REPO_ROOT / top).rglob("*.py")}
    edges = {name: _imports(path, name, set(paths)) for name, path in paths.items()}
    assert edges["normlab.data.documents"] >= {"normlab.data.common"}  # the walk sees imports

    def reaches(start, goal, seen):
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in edges[start])

    cycles = sorted(name for name in edges if reaches(name, name, set()))
    assert cycles == [], f"modules on an import cycle: {cycles}"


def test_the_library_does_not_start_its_own_command_lines():
    """A study's training jobs run the training module (`-m normlab.train.run`), its scoring and report are function
    calls: no module under normlab/ outside its command lines (normlab/cli/) builds a command of `normlab.cli.*` or
    of the root train.py, a dependency upward that no import shows. Messages naming a command for a person to type
    (f-strings) are not commands."""
    started = []
    for path in sorted((REPO_ROOT / "normlab").rglob("*.py")):
        if "cli" in path.relative_to(REPO_ROOT / "normlab").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            parts = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node.right] if isinstance(
                node, ast.BinOp) and isinstance(node.op, ast.Div) else []
            started += [f"{path.name}:{node.lineno} {p.value}" for p in parts if isinstance(p, ast.Constant)
                        and isinstance(p.value, str) and ("normlab.cli" in p.value or p.value.endswith("train.py"))]
    assert started == []


def test_the_study_library_neither_imports_the_commands_nor_builds_argv_for_its_stages():
    """normlab/study is a library: its stages are functions with typed arguments (run_sharded calls them in spawned
    processes), the command lines that parse argv live in normlab/cli/ (signal.py's own `python -m` excepted).
    Before, the LR choice's processes were handed ["--runs", "a,b", "--dev-rows", "2000", ...]."""
    paths = sorted((REPO_ROOT / "normlab" / "study").glob("*.py"))
    study = {f"normlab.study.{p.stem}": p for p in paths}
    known = study | {"normlab.cli": None}
    upward = {n for n, p in study.items() if any(m.startswith("normlab.cli") for m in _imports(p, n, set(known)))}
    parsers = {p.name for p in paths if ".parse_args(" in p.read_text() and p.name != "signal.py"}
    assert (upward, parsers) == (set(), set())


def test_no_file_edits_sys_path():
    """Code is found by installing it (pip install -e .) or by PYTHONPATH, never by a file pushing a folder onto
    sys.path: such an edit makes an import work here that fails for a user."""
    edits = []
    for path in sorted(REPO_ROOT.glob("**/*.py")):
        if any(part.startswith(".") for part in path.relative_to(REPO_ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node) in ("sys.path.insert", "sys.path.append"):
                edits.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}")
    assert edits == []
