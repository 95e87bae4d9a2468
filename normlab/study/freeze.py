"""Freezing a finished study: meta.json names the commit whose code regenerates its report (`report_commit`), and
report.py at any later commit refuses the folder, so later changes to the engine can never rewrite a finished
study's verdicts. Freezing checks first that this commit regenerates the committed report byte for byte.

    python scripts/report.py docs/study-docs/records --freeze
"""

import tempfile
from pathlib import Path

from normlab.errors import StudyError
from normlab.files.formats import atomic_write_json
from normlab.paths import REPO_ROOT
from normlab.study.report import make_report, refuse_frozen, regenerate_command
from normlab.study.study_dir import StudyDir, git, git_commit

REGENERATED = ("report.md", "answer.png", "sweep.png")  # what report.py writes from the records


def unchanged_in_git(folder: Path) -> bool:
    """True where the folder is outside this checkout or git has it exactly as committed (untracked files count, and
    so do ignored ones: a study under the ignored studies/ is not in the commit whose worktree regenerates it)."""
    try:
        inside = Path(folder).resolve().relative_to(REPO_ROOT)
    except ValueError:
        return True
    status = git("status", "--porcelain", "--ignored", "--", str(inside)).splitlines()
    return not [line for line in status if not line.rstrip("/").endswith("__pycache__")]  # (bytecode is not records)


def freeze(folder: Path) -> str:
    """Regenerate the folder's report at this commit into a temporary folder; where every file of REGENERATED it
    holds is byte-identical, write this commit into its meta.json and return it. Refused in one line (StudyError):
    a frozen study, uncommitted code or records (the commit named must be what regenerated them), or a difference."""
    folder = StudyDir(folder)
    refuse_frozen(folder)
    commit = git_commit()
    if not commit or commit.endswith("+dirty") or not unchanged_in_git(folder.path):
        raise StudyError(f"cannot freeze {folder.path} at {commit or 'no commit'}: commit the code and the records "
                         f"first, so that the commit named regenerates them")
    with tempfile.TemporaryDirectory() as tmp:
        make_report(folder.path, Path(tmp))
        differ = [name for name in REGENERATED if (folder / name).is_file()
                  and (folder / name).read_bytes() != (Path(tmp) / name).read_bytes()]
    if differ:
        raise StudyError(f"cannot freeze {folder.path} at {commit}: {', '.join(differ)} differ from what this commit "
                         f"regenerates; report it again (python scripts/report.py {folder.path}), commit, then freeze")
    meta = folder.meta()
    frozen = {"name": meta.get("name"), "report_commit": commit,
              "report_command": regenerate_command(folder, commit)}
    atomic_write_json(folder.meta_file, {**frozen, **meta}, indent=1)
    return commit
