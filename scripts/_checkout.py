"""What every scripts/*.py does: run a normlab command with the code of the checkout the script lives in.

Its root goes first on sys.path, before an editable install of another clone (or of HEAD, where this checkout is a
worktree at the commit a frozen study regenerates at), so the script never silently runs someone else's code.
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(module: str) -> None:
    sys.path.insert(0, str(ROOT))
    runpy.run_module(module, run_name="__main__", alter_sys=True)
