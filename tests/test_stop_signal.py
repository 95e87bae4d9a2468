"""normlab.train.stop_signal with real signals from another process: the first SIGTERM/SIGINT asks for a stop, a
repeat within the window (a launcher passing the stop on, a signal to the whole group) is the same request, and a
later one aborts with the handler that was there before. Under `accelerate launch`, end to end:
tests/test_reliability.py."""

import signal
import subprocess
import sys

import pytest

from train_utils import REPO, env, terminal_signals

# Stands in for the training loop: installs the handlers, says so, and stops when told on stdin (every signal has
# been delivered by then) or when a signal ends it.
SCRIPT = """
import sys
from normlab.train.stop_signal import StopSignal

with StopSignal(same_request_s=float(sys.argv[1])).installed() as stop:
    print("ready", flush=True)
    sys.stdin.readline()
    print("stop requested by", stop.signum, flush=True)
"""


def deliver(signals, same_request_s) -> subprocess.CompletedProcess:
    """Run SCRIPT and send it `signals`, each after the previous one was handled (two signals sent back to back
    could reach it as one: the kernel keeps one pending signal of a kind)."""
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(same_request_s)], cwd=REPO, env=env(),
                            preexec_fn=terminal_signals,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signals[0])
        said = proc.stderr.readline() + proc.stderr.readline()  # a blank line, then what it does
        assert "saving a checkpoint at the end of this step" in said
        for signum in signals[1:]:
            proc.send_signal(signum)
        out, err = proc.communicate("go on\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, said + err)


@pytest.mark.parametrize("signals", [
    [signal.SIGTERM, signal.SIGTERM],  # a group's SIGTERM, then accelerate's launcher passing its own on
    [signal.SIGINT, signal.SIGTERM],  # Ctrl-C in the terminal, then the launcher's SIGTERM
    [signal.SIGINT, signal.SIGINT, signal.SIGINT],
], ids=["term-term", "int-term", "int-int-int"])
def test_repeats_within_the_window_are_one_request(signals):
    done = deliver(signals, same_request_s=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == f"stop requested by {signals[0]}"
    assert done.stderr.count("received") == 1  # said once


def test_a_sigterm_after_the_window_ends_the_process_at_once():
    done = deliver([signal.SIGTERM, signal.SIGTERM], same_request_s=0)
    assert done.returncode == -signal.SIGTERM  # SIGTERM's default action: a shell reports 143
    assert "stop requested" not in done.stdout


def test_a_sigint_after_the_window_raises_keyboard_interrupt():
    done = deliver([signal.SIGTERM, signal.SIGINT], same_request_s=0)
    assert done.stderr.rstrip().endswith("KeyboardInterrupt")
    assert done.returncode == -signal.SIGINT  # how Python ends on an uncaught KeyboardInterrupt (a shell's 130)
    assert "stop requested" not in done.stdout


def test_the_previous_handlers_come_back():
    from normlab.train.stop_signal import StopSignal

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with StopSignal().installed() as stop:
        assert signal.getsignal(signal.SIGINT) == stop._handle
    assert {s: signal.getsignal(s) for s in before} == before
