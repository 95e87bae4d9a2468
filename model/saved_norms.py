"""The norms a saved model carries that NormLab's norms.py does not define: none here. A saved model's copy of this
file is written by norm_code.py's `save_norm_code`: it imports each such norm's module, saved beside it, and
registers the names its config uses, so that configuration_normlab.py (which imports this file) finds them when
the folder is loaded with `trust_remote_code=True`.
"""

SAVED_NORMS: tuple[str, ...] = ()  # the names this file registers
