"""What every NormLab command line shares: a parser described by its module's docstring, and the exit for bad input
(one `PROG: error: ...` line on stderr, exit code 2, as argparse's own errors). Directly under normlab/ because the
study's commands (normlab/study/) use it as well as normlab/cli/."""

import argparse
import sys

EXIT_BAD_INPUT = 2  # argparse's code for a bad command line


def command_parser(doc: str, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser whose description is the first paragraph of `doc` (the module's docstring)."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], **kwargs)


def error_exit(prog: str, problem) -> int:
    """Print `prog: error: problem` on stderr as one line, however the message was wrapped; the exit code."""
    print(f"{prog}: error: {' '.join(str(problem).split())}", file=sys.stderr)
    return EXIT_BAD_INPUT
