"""Score a study's final models and write its per-run records (normlab_study/scoring.py says what is scored).

    python scripts/score_runs.py studies/quick          # -> studies/quick/runs.jsonl and labels.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python scripts/x.py` puts scripts/, not the repo, first

from normlab_study.scoring import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
