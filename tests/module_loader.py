"""Code the tests import that is not on sys.path: the GPU check's tools in scripts/gpu/ (not a package) and a downloaded
package (tests/hf_common.py), imported from their files without putting their folders on sys.path."""

import importlib.util
import sys
from pathlib import Path

GPU_TOOLS = Path(__file__).resolve().parent.parent / "scripts" / "gpu"


def load_module(name: str, path: Path):
    """The module at `path` (a .py file, or a folder with __init__.py: a package) imported as `name`, once."""
    if name not in sys.modules:
        package = [str(path)] if path.is_dir() else None
        spec = importlib.util.spec_from_file_location(name, path / "__init__.py" if package else path,
                                                      submodule_search_locations=package)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)  # first, as `import` does: its dataclasses
        try:                                                                  # and relative imports look it up
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
