"""Run a norm study (normlab/study/runner.py; docs/studies.md).

    python scripts/study.py --preset quick --parallel 2     # configs/study/quick.yaml on a 2-core CPU
    python scripts/study.py --preset quick --dry-run        # print the runs, train nothing
    python scripts/study.py --preset full --study-dir studies/full-h100
"""

import sys

from normlab.study.runner import main

if __name__ == "__main__":
    sys.exit(main())
