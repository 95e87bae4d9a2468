"""Score a study's final models and write its per-run records (normlab/study/scoring.py says what is scored).

    python scripts/score_runs.py studies/quick          # -> studies/quick/runs.jsonl and labels.json
"""

import sys
from pathlib import Path

from normlab.command import command_parser
from normlab.study.scoring import score
from normlab.study.sharded import add_shard_options
from normlab.study.study_dir import SCORED


def main(argv=None) -> int:
    parser = command_parser(__doc__)
    parser.add_argument("study_dir", type=Path)
    add_shard_options(parser, "score", SCORED)
    args = parser.parse_args(argv)
    count = score(args.study_dir, shard=args.shard, out=args.out)
    print(f"{count} records -> {args.out or args.study_dir / SCORED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
