"""The error classes that modules on both sides of the config share; a leaf module (no imports), so raising one
imports nothing else. Each message is one line naming the problem and what is valid."""


class ConfigError(ValueError):
    """A bad config key or value; the message names the key and what is valid."""


class RecordsError(ValueError):
    """A study's records that cannot join the committed ones in a folder; the message says why and what to do."""


class StudyError(ValueError):
    """A study that cannot be planned, run or reported as asked; the message says what and what is valid."""
