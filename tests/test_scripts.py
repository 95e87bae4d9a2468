"""scripts/*.py run the code of the checkout they live in (scripts/_checkout.py), never a normlab found first on the
path: in a worktree at an older commit, with another checkout installed editable, the script runs that commit."""

import ast
import importlib.util
import os
import subprocess
import sys

from normlab.study.grid import REPO_ROOT

SCRIPTS = sorted(p for p in (REPO_ROOT / "scripts").glob("*.py") if not p.name.startswith("_"))


def test_every_script_runs_its_own_cli_module_through_the_checkout_helper():
    assert len(SCRIPTS) >= 9
    for script in SCRIPTS:
        calls = [n for n in ast.walk(ast.parse(script.read_text()))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "run"]
        assert [c.args[0].value for c in calls] == [f"normlab.cli.{script.stem}"], script
        assert importlib.util.find_spec(f"normlab.cli.{script.stem}"), script


def test_a_script_imports_normlab_from_its_own_checkout_not_one_earlier_on_the_path(tmp_path):
    other = tmp_path / "other_checkout" / "normlab"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("raise ImportError('the other checkout was imported')\n")
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "report.py"), "--help"], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(other.parent)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: report.py")
