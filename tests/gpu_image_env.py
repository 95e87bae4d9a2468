"""The GPU machine's conditions, emulated here for tests/test_gpu_check.py: its package set (what this machine has
and the image lacks is blocked from import, through tests/gpu_image/sitecustomize.py; NormLab itself is not
installed there, so an editable install here is hidden too and its packages come from the checkout, as
gpu_check.sh puts them on PYTHONPATH), its `python3` (and no `python`), and the device's returned folder $OUT."""

import importlib.metadata as md
import os
import sys
from pathlib import Path

from module_loader import GPU_TOOLS, load_module

gpu_prepare = load_module("gpu_prepare", GPU_TOOLS / "gpu_prepare.py")

BLOCKER = Path(__file__).resolve().parent / "gpu_image"
REPO = BLOCKER.parent.parent
# the checkout's own top-level packages: importable from it on the image, whatever is installed here
OWN_PACKAGES = {p.parent.name for p in REPO.glob("*/__init__.py")}


def absent_on_image(with_wheels: bool) -> set[str]:
    """Distributions installed here that the image does not have: not in its list, and not needed by the versions
    installed here of what it has (the image has its own versions of those, with their own needs). With the wheels,
    what gpu_prepare.py carries is there."""
    image = gpu_prepare.image_packages()
    here = {gpu_prepare.normalize(d.metadata["Name"]) for d in md.distributions()}
    absent = here - image - set(gpu_prepare.requirement_closure(sorted(image & here)))
    return absent - set(gpu_prepare.plan()) if with_wheels else absent


def image_env(base: dict, tmp: Path, with_wheels: bool) -> dict:
    """`base` with the image's package set, python3 only on PATH, and $OUT set to tmp/out."""
    dists = absent_on_image(with_wheels)
    modules = {m for m, owners in md.packages_distributions().items()
               if all(gpu_prepare.normalize(o) in dists for o in owners)} - OWN_PACKAGES
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    # a script, not a link: a venv's python reached through a link outside the venv does not find its pyvenv.cfg
    (bin_dir / "python3").write_text(f"#!/bin/sh\nexec '{sys.executable}' \"$@\"\n")
    (bin_dir / "python3").chmod(0o755)
    (bin_dir / "python").write_text("#!/bin/sh\necho 'the GPU image has no python, only python3' >&2\nexit 127\n")
    (bin_dir / "python").chmod(0o755)
    env = {**base, "NORMLAB_BLOCKED_DISTS": ",".join(sorted(dists)),
           "NORMLAB_BLOCKED_MODULES": ",".join(sorted(modules)), "PYTHONPATH": str(BLOCKER),
           "PATH": f"{bin_dir}{os.pathsep}{base['PATH']}", "OUT": str(tmp / "out"),
           "GPU_CHECK_WORK": str(tmp / "work"), "GPU_CHECK_WHEELS": str(tmp / "no_wheels")}
    env.pop("PYTHON", None)
    env.pop("GPU_CHECK_DEST", None)
    return env
