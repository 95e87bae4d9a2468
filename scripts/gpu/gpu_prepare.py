"""Prepare what the GPU check (scripts/gpu/gpu_check.sh) needs on the lent GPU machine, which reaches no registry:

    python scripts/gpu/gpu_prepare.py              # wheels into .whl/, SST-2 and the source record into .gpudata/
    python scripts/gpu/gpu_prepare.py --plan       # only print what would be downloaded, as JSON
    python scripts/gpu/gpu_prepare.py --payload    # only measure what the device call would carry now
    python3 scripts/gpu/gpu_prepare.py --source .gpudata   # (gpu_check.sh, on the device) one line: the commit checked

Wheels: every distribution the check imports (CHECK_NEEDS and what they require, at the versions installed here,
where the test suite runs) that the GPU image lacks (docs/gpu_image_packages.txt), one version each, built for the
image's Python (3.12, CPython, x86_64 manylinux). pip installs them there without resolving dependencies, and one
wheel it rejects stops the whole install: hence one file per distribution, and for the image's Python.
Data: a copy of SST-2 (train.py looks in $NORMLAB_DATA_DIR/sst2; gpu_check.sh points it at .gpudata).
Source: .gpudata/source.json names the commit, whether the tree differed from it, and a digest of the files the
device copies (.git does not travel), so the report can say what it checked.
Both travel with the device call's `carry`, 64 MiB together with the working tree: payload() measures all of it as
the device copies it, here and in the quick tests, and fails above PAYLOAD_LIMIT_MIB.
Needs only the standard library and `packaging`: it runs from a plain checkout, without NormLab installed (the data
lookup runs in a child Python with this checkout on its PYTHONPATH, as gpu_check.sh runs NormLab).
"""

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
IMAGE_PACKAGES = REPO / "docs" / "gpu_image_packages.txt"
# what gpu_check.sh runs imports: train.py, scripts/bench.py, scripts/gpu/ln_bench.py, the Triton tests
CHECK_NEEDS = ("torch", "transformers", "accelerate", "datasets", "tokenizers", "safetensors", "omegaconf", "pyyaml",
               "numpy", "triton", "pytest")
# on the image at an unknown version (docs/gpu_image_packages.txt has names only) that datasets 5.2 bounds from above
# (fsspec <= 2026.9.0), a newer image's could be past it: the version installed here travels (0.2 MiB). Not pyarrow,
# which datasets bounds from below (>= 24): its wheel (47 MiB) cannot travel beside the tree, and datasets loads SST-2
# and trains on pyarrow 21 here (docs/gpu.md); the environment section reports the image's against the bound.
CARRY_ANYWAY = ("fsspec",)
IMAGE_PYTHON = "3.12"
# the image's side of every environment marker: CPython 3.12 on Linux x86_64, no extras requested
IMAGE_MARKER_ENV = {"python_version": IMAGE_PYTHON, "python_full_version": f"{IMAGE_PYTHON}.0",
                    "implementation_name": "cpython", "platform_python_implementation": "CPython",
                    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                    "os_name": "posix", "extra": ""}
# pip matches manylinux tags exactly: name every tag a current wheel may carry
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
DEVICE_LIMIT_MIB = 64  # what one device call copies: the working tree and the carried paths together
PAYLOAD_LIMIT_MIB = 60  # preparing and the quick test fail above it: 4 MiB for what is committed before the call
CARRY = (".whl", ".gpudata")  # the call's `carry`: the wheels and the data folder, both gitignored
# the most each carried folder may hold: its size where it is not prepared (CI, a fresh checkout), so the quick test
# measures a whole payload without downloading; preparing fails when one holds more
CARRY_ALLOWANCE_MIB = {".whl": 3, ".gpudata": 3}
SOURCE = "source.json"  # in the data folder


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    lines = path.read_text().splitlines()
    return {normalize(x) for x in (line.strip() for line in lines) if x and not x.startswith("#")}


def requirement_closure(roots, stop_at=frozenset(), missing: list | None = None) -> dict[str, str]:
    """{distribution: version installed here} for `roots` and everything they require, not descending into the
    distributions in `stop_at` (the image has its own versions of those, with their own needs met) nor into extras
    (the wheels are installed without dependency resolution: an optional dependency never comes along). What is
    needed but not installed here goes to `missing`, as "name (needed by whom)"."""
    found, stack = {}, [(r, "the check") for r in roots]
    while stack:
        name, needed_by = stack.pop()
        name = normalize(name)
        if name in found or name in stop_at:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if missing is not None:
                missing.append(f"{name} (needed by {needed_by})")
            continue
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(IMAGE_MARKER_ENV):
                stack.append((req.name, name))
    return found


def plan(image: set[str] | None = None) -> dict[str, str]:
    """{distribution: version} to carry: what the check imports that the image lacks, with its own needs, and
    CARRY_ANYWAY. A needed distribution that is neither on the image nor installed here stops it (one line)."""
    image = image_packages() if image is None else image
    missing = []
    pins = requirement_closure((*CHECK_NEEDS, *CARRY_ANYWAY), stop_at=image - set(CARRY_ANYWAY), missing=missing)
    if missing:
        raise SystemExit(f"error: neither on the GPU image nor installed here: {', '.join(sorted(missing))}; "
                         f"install them here first (pip install -r requirements.txt)")
    return dict(sorted(pins.items()))


def pip_download_command(pins: dict[str, str], dest: Path) -> list[str]:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
            IMAGE_PYTHON, "--implementation", "cp", *platforms, "-d", str(dest),
            *(f"{k}=={v}" for k, v in pins.items())]


def download(pins: dict[str, str], dest: Path) -> list[Path]:
    """The wheels of `pins` in `dest`, and nothing else there (an older version left over would stop the install).
    Downloaded into a folder beside it first: the wheels already in `dest` go only once all of their replacements
    are there."""
    if not pins:
        raise SystemExit(f"error: nothing to carry (an empty plan); {dest} left as it was")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-new-") as tmp:
        new = Path(tmp)
        if subprocess.run(pip_download_command(pins, new)).returncode != 0:
            raise SystemExit(f"error: pip download failed (its message is above); {dest} left as it was")
        got = sorted(normalize(w.name.split("-")[0]) for w in new.glob("*.whl"))  # a wheel is named dist-version-...
        if got != sorted(pins):
            raise SystemExit(f"error: downloaded wheels {got} do not match the plan {sorted(pins)}; {dest} left as "
                             f"it was")
        for old in dest.glob("*.whl"):
            old.unlink()
        for wheel in new.glob("*.whl"):
            shutil.move(str(wheel), dest / wheel.name)
    return sorted(dest.glob("*.whl"))


def sst2_source() -> Path | None:
    """Where train.py finds SST-2 here (normlab/data/sources.py's lookup), asked of a child Python with this checkout
    on its PYTHONPATH, so that NormLab need not be installed; None where there is no local copy."""
    code = ("from normlab.data.sources import mirror_candidates; "
            "print(next((str(p) for p in mirror_candidates('sst2') if p.is_dir()), ''))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    found = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    return Path(found) if found else None


def copy_data(dest: Path) -> Path:
    """SST-2 from where train.py finds it here into dest/sst2."""
    src = sst2_source()
    if src is None:
        raise SystemExit("error: no local copy of SST-2 (../shared/datasets/sst2 or $NORMLAB_DATA_DIR/sst2)")
    target = dest / "sst2"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for f in src.iterdir():  # files only, without the source's read-only modes
        if f.is_file() and f.suffix != ".md":
            shutil.copyfile(f, target / f.name)
    return target


def tree_digest(root: Path, files) -> str:
    """sha256 over the paths and contents of `files` (relative to root); a missing file counts as empty."""
    h = hashlib.sha256()
    for name in sorted(files):
        path = root / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
    return h.hexdigest()


def _git(*args, root: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def device_files(root: Path = REPO) -> list[str]:
    """The checkout's files the device copies besides `carry` (paths relative to root): tracked ones and untracked
    ones git does not ignore; and shared/, which travels whole where the checkout has one."""
    files = {f for f in _git("ls-files", "-co", "--exclude-standard", "-z", root=root).split("\0") if f}
    shared = root / "shared"
    if shared.is_dir() and not shared.is_symlink():
        files |= {str(f.relative_to(root)) for f in shared.rglob("*") if f.is_file() or f.is_symlink()}
    return sorted(files)


def _bytes(path: Path) -> int:
    """What a path adds to the copy: a link travels as a link, a folder as the files under it."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() or f.is_symlink()) if path.is_dir() else 0


@dataclass
class Payload:
    """MiB one device call copies: "tree" (device_files) and each carried path; `allowed` names the carried paths
    not there, counted at their allowance."""
    parts: dict[str, float]
    allowed: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {mib:.1f}" + (" (not prepared: its allowance)" if name in self.allowed else "")
                          for name, mib in self.parts.items())
        return (f"payload {self.total:.1f} MiB ({parts}); the device takes {DEVICE_LIMIT_MIB}, this check "
                f"{PAYLOAD_LIMIT_MIB}")

    def problems(self) -> list[str]:
        """Why it would not do for a device call: over the limit, or a carried folder over its allowance."""
        over = [f"{name} holds {self.parts[name]:.1f} MiB, over its allowance of {CARRY_ALLOWANCE_MIB[name]} MiB "
                f"(which the quick test counts where it is not prepared)"
                for name in CARRY if self.parts[name] > CARRY_ALLOWANCE_MIB[name]]
        if self.total > PAYLOAD_LIMIT_MIB:
            over.append(f"{self.total:.1f} MiB to copy is over {PAYLOAD_LIMIT_MIB} MiB, the limit that leaves "
                        f"{DEVICE_LIMIT_MIB - PAYLOAD_LIMIT_MIB} MiB of the device's {DEVICE_LIMIT_MIB} for what is "
                        f"committed before the call: commit records compressed, carry less (docs/gpu.md)")
        return over


def payload(root: Path = REPO, carried: dict[str, Path] | None = None) -> Payload:
    """What one device call copies from the checkout at `root`, measured as the device copies it: its device_files
    and each path of CARRY, at `carried`'s place for it (--wheels, --data) or else in root."""
    places = {name: Path((carried or {}).get(name, root / name)) for name in CARRY}
    parts = {"tree": sum(_bytes(root / f) for f in device_files(root)) / 2**20}
    parts.update({name: _bytes(path) / 2**20 if path.exists() else float(CARRY_ALLOWANCE_MIB[name])
                  for name, path in places.items()})
    return Payload(parts, tuple(name for name, path in places.items() if not path.exists()))


def source_record() -> dict:
    """The commit checked out here, the changes beside it (`git status`), and the files the device copies
    (device_files) with their digest."""
    files = device_files()
    changed = _git("status", "--porcelain").splitlines()
    return {"commit": _git("rev-parse", "HEAD").strip(), "dirty": bool(changed), "changed": changed,
            "prepared_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": files,
            "tree_sha256": tree_digest(REPO, files)}


def describe_source(record: dict | None, root: Path = REPO) -> str:
    """One line for the report: the commit, clean or dirty, and whether the tree here is the one prepared."""
    if record is None:
        try:
            record = {**source_record(), "here": True}
        except (OSError, subprocess.CalledProcessError):
            return "commit unknown (no source record and no git)"
    state = f"dirty: {len(record['changed'])} changed" if record["dirty"] else "clean"
    if record.get("here"):
        return f"commit {record['commit']} ({state}; read from git here)"
    same = tree_digest(root, record["files"]) == record["tree_sha256"]
    return (f"commit {record['commit']} ({state}; prepared {record['prepared_utc']}; "
            f"{'tree as prepared' if same else 'TREE CHANGED since it was prepared'})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", action="store_true", help="print the wheels to download (JSON) and stop")
    ap.add_argument("--payload", action="store_true", help="print what the device call would copy now and stop "
                                                            "(exit 1 where it would not do)")
    ap.add_argument("--wheels", default=str(REPO / ".whl"))
    ap.add_argument("--data", default=str(REPO / ".gpudata"))
    ap.add_argument("--source", metavar="DATA_DIR", help="print the commit the source record there names, and stop")
    args = ap.parse_args(argv)
    if args.source:
        path = Path(args.source) / SOURCE
        print(describe_source(json.loads(path.read_text()) if path.is_file() else None))
        return 0
    carried = {".whl": Path(args.wheels), ".gpudata": Path(args.data)}
    if args.payload:
        return check_payload(payload(carried=carried))
    pins = plan()
    if args.plan:
        print(json.dumps({"python": IMAGE_PYTHON, "wheels": pins, "carried_anyway": CARRY_ANYWAY,
                          "command": pip_download_command(pins, Path(args.wheels))[1:]}))
        return 0
    record = source_record()  # first: without git there is no commit to name, and nothing is touched yet
    wheels = download(pins, Path(args.wheels))
    data = copy_data(Path(args.data))
    (Path(args.data) / SOURCE).write_text(json.dumps(record, indent=1))
    print(f"{len(wheels)} wheels in {args.wheels}, SST-2 in {data}; {describe_source(record)}")
    return check_payload(payload(carried=carried))


def check_payload(measured: Payload) -> int:
    print(measured)
    problems = measured.problems()
    if problems:
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
