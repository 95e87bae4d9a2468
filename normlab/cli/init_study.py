"""E1 of a study: per-block gradient norms at initialization and the first Adam updates, no training
(normlab/study/init_exp.py).

    python scripts/init_study.py studies/quick            # the `init` block of STUDY/study.json
"""

import sys

from normlab.study.init_exp import main

if __name__ == "__main__":
    sys.exit(main())
