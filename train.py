"""Train a NormLab encoder: `accelerate launch train.py [--config FILE] [--debug] [key=value ...]`.

    accelerate launch train.py                                   # the default run (configs/default.yaml)
    accelerate launch train.py --config post_ln model.norm=rmsnorm train.lr=1e-3
    python train.py output_dir=runs/x train.resume=auto          # continue a run (its own config comes back)

The run itself (setup, the training loop, the end) is normlab/train/run.py, which the installed `normlab-train`
command runs too: the same main, arguments and exit codes (0 ok, 1 crash, 2 bad input, 3 a refused write). This file
is the user's entry point only: a study starts `python -m normlab.train.run` (or calls its main in a warm worker).
"""

import sys

# first import: it sets OpenMP's wait policy before anything loads torch
from normlab.train.run import EXIT_BAD_INPUT, EXIT_CRASH, EXIT_OK, EXIT_WRITE_FAILED, main

__all__ = ["main", "EXIT_OK", "EXIT_CRASH", "EXIT_BAD_INPUT", "EXIT_WRITE_FAILED"]

if __name__ == "__main__":
    sys.exit(main())
