"""The dev loss of each named run's final model, what a study's LR choice compares (normlab/study/selection.py).

    python -m normlab.cli.dev_losses studies/quick --runs NAME,NAME   # -> studies/quick/dev_losses.jsonl
"""

import sys

from normlab.study.selection import main

if __name__ == "__main__":
    sys.exit(main())
