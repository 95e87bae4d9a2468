"""Prepare what the GPU check (scripts/gpu_check.sh) needs on the lent GPU machine, which reaches no package registry:

    python scripts/gpu_prepare.py              # wheels into .whl/, SST-2 into .gpudata/sst2 (both gitignored)
    python scripts/gpu_prepare.py --plan       # only print what would be downloaded, as JSON

Wheels: every distribution the check imports (CHECK_NEEDS and what they require, at the versions installed here,
where the test suite runs) that the GPU image lacks (docs/gpu_image_packages.txt), one version each, built for the
image's Python (3.12, CPython, x86_64 manylinux). pip installs them there without resolving dependencies, and one
wheel it rejects stops the whole install: hence one file per distribution, and for the image's Python.
Data: a copy of SST-2 (train.py looks in $NORMLAB_DATA_DIR/sst2; gpu_check.sh points it at .gpudata).
Both travel with the device call's `carry` (64 MiB together with the working tree): the total is checked here.
"""

import argparse
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
IMAGE_PACKAGES = REPO / "docs" / "gpu_image_packages.txt"
# what gpu_check.sh runs imports: train.py, scripts/bench.py, scripts/ln_bench.py, the Triton tests
CHECK_NEEDS = ("torch", "transformers", "accelerate", "datasets", "tokenizers", "safetensors", "omegaconf", "pyyaml",
               "numpy", "triton", "pytest")
IMAGE_PYTHON = "3.12"
# the image's side of every environment marker: CPython 3.12 on Linux x86_64, no extras requested
IMAGE_MARKER_ENV = {"python_version": IMAGE_PYTHON, "python_full_version": f"{IMAGE_PYTHON}.0",
                    "implementation_name": "cpython", "platform_python_implementation": "CPython",
                    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                    "os_name": "posix", "extra": ""}
# pip matches manylinux tags exactly: name every tag a current wheel may carry
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
CARRY_LIMIT_MIB = 64  # the device call's working tree, carried paths included
CARRY_BUDGET_MIB = 40  # wheels + data: the rest is left to the working tree


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    lines = path.read_text().splitlines()
    return {normalize(x) for x in (line.strip() for line in lines) if x and not x.startswith("#")}


def requirement_closure(roots, stop_at=frozenset()) -> dict[str, str]:
    """{distribution: version installed here} for `roots` and everything they require, not descending into the
    distributions in `stop_at` (the image has its own versions of those, with their own needs met) nor into extras
    (the wheels are installed without dependency resolution: an optional dependency never comes along)."""
    found, stack = {}, list(roots)
    while stack:
        name = normalize(stack.pop())
        if name in found or name in stop_at:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # not installed here: nothing here imports it either
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(IMAGE_MARKER_ENV):
                stack.append(req.name)
    return found


def plan(image: set[str] | None = None) -> dict[str, str]:
    """{distribution: version} to carry: what the check imports that the image lacks, with its own needs."""
    image = image_packages() if image is None else image
    return dict(sorted(requirement_closure(CHECK_NEEDS, stop_at=image).items()))


def pip_download_command(pins: dict[str, str], dest: Path) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
            IMAGE_PYTHON, "--implementation", "cp", *platforms, "-d", str(dest),
            *(f"{k}=={v}" for k, v in pins.items())]


def wheel_distribution(path: Path) -> str:
    return normalize(path.name.split("-")[0])


def download(pins: dict[str, str], dest: Path) -> list[Path]:
    """The wheels of `pins` in `dest`, and nothing else there (an older version left over would stop the install)."""
    dest.mkdir(exist_ok=True)
    for old in dest.glob("*.whl"):
        if pins.get(wheel_distribution(old)) not in old.name:
            old.unlink()
    subprocess.run(pip_download_command(pins, dest), check=True)
    wheels = sorted(dest.glob("*.whl"))
    got = [wheel_distribution(w) for w in wheels]
    if sorted(got) != sorted(pins) or len(set(got)) != len(got):
        raise SystemExit(f"gpu_prepare.py: wheels {got} do not match the plan {sorted(pins)}")
    return wheels


def copy_data(dest: Path) -> Path:
    """SST-2 from where train.py finds it here (common/data.py's lookup) into dest/sst2."""
    from common.data import mirror_candidates

    src = next((p for p in mirror_candidates("sst2") if p.is_dir()), None)
    if src is None:
        raise SystemExit("gpu_prepare.py: no local copy of SST-2 (../shared/datasets/sst2 or $NORMLAB_DATA_DIR/sst2)")
    target = dest / "sst2"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for f in src.iterdir():  # files only, without the source's read-only modes
        if f.is_file() and f.suffix != ".md":
            shutil.copyfile(f, target / f.name)
    return target


def mib(paths) -> float:
    return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", action="store_true", help="print the wheels to download (JSON) and stop")
    ap.add_argument("--wheels", default=str(REPO / ".whl"))
    ap.add_argument("--data", default=str(REPO / ".gpudata"))
    args = ap.parse_args(argv)
    pins = plan()
    if args.plan:
        print(json.dumps({"python": IMAGE_PYTHON, "wheels": pins, "command": pip_download_command(pins, Path(
            args.wheels))[1:]}))
        return 0
    wheels = download(pins, Path(args.wheels))
    data = copy_data(Path(args.data))
    size = mib([*wheels, data])
    print(f"{len(wheels)} wheels in {args.wheels}, SST-2 in {data}: {size:.1f} MiB to carry")
    if size > CARRY_BUDGET_MIB:
        raise SystemExit(f"gpu_prepare.py: {size:.1f} MiB is over {CARRY_BUDGET_MIB} MiB (carry limit "
                         f"{CARRY_LIMIT_MIB} MiB with the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
