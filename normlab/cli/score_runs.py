"""Score a study's final models and write its per-run records (normlab/study/scoring.py says what is scored).

    python scripts/score_runs.py studies/quick          # -> studies/quick/runs.jsonl and labels.json
"""

import sys

from normlab.study.scoring import main

if __name__ == "__main__":
    sys.exit(main())
