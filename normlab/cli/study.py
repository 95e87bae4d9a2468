"""Run a norm study (normlab/study/runner.py; docs/studies.md).

    python scripts/study.py --preset smoke --parallel 1     # configs/study/smoke.yaml: the pipeline in minutes
    python scripts/study.py --preset quick_v4 --parallel 2  # configs/study/quick_v4.yaml on a 2-core CPU
    python scripts/study.py --preset quick --dry-run        # print the runs, train nothing
    python scripts/study.py --preset full --study-dir studies/full-h100
"""

import sys

from normlab.study.runner import main

if __name__ == "__main__":
    sys.exit(main())
