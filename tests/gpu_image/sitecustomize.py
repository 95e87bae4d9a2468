"""Makes this Python look like the GPU image's, for tests/test_gpu_check.py: on PYTHONPATH, Python imports this at
start-up (and so does every Python process started under it: accelerate's launcher, pytest, train.py).

$NORMLAB_BLOCKED_DISTS (comma-separated distribution names) are made absent: their top-level modules
($NORMLAB_BLOCKED_MODULES) cannot be imported, importlib.metadata does not see them (transformers and pytest
look packages up there before importing them), and the import hook of an editable install of one (setuptools'
__editable___<name>_<version>_finder, installed by a .pth file before this runs) is removed.
"""

import importlib.machinery
import importlib.metadata as md
import os
import re
import sys


def _names(var):
    return frozenset(x for x in os.environ.get(var, "").split(",") if x)


_DISTS = frozenset(re.sub(r"[-_.]+", "-", d).lower() for d in _names("NORMLAB_BLOCKED_DISTS"))
_MODULES = _names("NORMLAB_BLOCKED_MODULES")


class _ImagePathFinder(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.split(".")[0] in _MODULES:
            return None  # as for a module that is not installed
        return super().find_spec(fullname, path, target)


def _blocked(dist) -> bool:
    name = dist.metadata["Name"] if dist.metadata else None
    return bool(name) and re.sub(r"[-_.]+", "-", name).lower() in _DISTS


def _editable_hook_of_blocked(finder) -> bool:
    module = getattr(finder, "__module__", None) or type(finder).__module__
    return module.startswith("__editable__") and any(f"___{d.replace('-', '_')}_" in module for d in _DISTS)


if _DISTS or _MODULES:
    sys.meta_path[:] = [_ImagePathFinder if f is importlib.machinery.PathFinder else f for f in sys.meta_path
                        if not _editable_hook_of_blocked(f)]
    _all_distributions, _from_name = md.distributions, md.Distribution.from_name.__func__

    def _distributions(**kwargs):
        return (d for d in _all_distributions(**kwargs) if not _blocked(d))

    def _distribution_from_name(cls, name):
        if re.sub(r"[-_.]+", "-", name).lower() in _DISTS:
            raise md.PackageNotFoundError(name)
        return _from_name(cls, name)

    md.distributions = _distributions
    md.Distribution.from_name = classmethod(_distribution_from_name)
