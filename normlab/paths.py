"""Where the checkout is: the folder that holds configs/, train.py and the default .cache/. A leaf module."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
