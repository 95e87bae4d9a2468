"""Imports point down: the data and write helpers do not import the config (and through it model/ and the
kernels), and the run config reads the kernel mode names without importing the kernel package."""

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
