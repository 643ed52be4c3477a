"""Run a command (pytest) while the course's pretrained decoder trains beside it. Run by `make`.

    .venv/bin/python scripts/with_pretrained_decoder.py -- COMMAND [ARGS...]

Why: on a clean cache the first test that needs the pretrained decoder
(tests/test_pretrained.py, halfway through `make test`) trains it: about 4 minutes of
single-threaded CPU work the whole suite waits for. Started here, at the start of pytest, the
same training overlaps with the tests that come first (about 15 minutes of them); when the
fixture gets there it finds the cache, or waits on the cache's lock file for the run in
progress (``minidist.models.pretrained.checkpoint_dir``: never two trainings).

The background run

* is ``python -m minidist.models.pretrained --ensure course`` with this environment, so it
  fills the same ``$MINIDIST_CACHE`` as the tests; with a warm cache it returns at once;
* runs at a lower priority (nice 10): the tests keep the CPU they need, the training takes
  what is left;
* is stopped when COMMAND ends (whatever the outcome), when this script is interrupted, or
  after ``TIMEOUT_S``; it dies with this script even if this one is killed outright (SIGKILL:
  the kernel's parent-death signal);
* never decides the outcome: its output goes to a log printed at the end if it failed, and
  the exit status is COMMAND's. A test that needs the model trains it itself when the
  background run failed or was stopped.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

MODEL = "course"
# Well past the training's ~4 minutes on a loaded machine, and early enough that a test waiting
# on the lock still has time to train the model itself within its own timeout (1200 s).
TIMEOUT_S = 20 * 60
NICENESS = 10
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_GRACE_S = 10


def _lower_priority_and_die_with_parent() -> None:
    """In the background child before exec: nice it, and have the kernel TERM it if we die."""
    os.nice(NICENESS)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def start_training(log) -> subprocess.Popen:  # noqa: ANN001
    """The background run, in its own session (a Ctrl-C in the terminal is ours to pass on)."""
    return subprocess.Popen(
        [sys.executable, "-m", "minidist.models.pretrained", "--ensure", MODEL],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_lower_priority_and_die_with_parent,
    )


def stop(proc: subprocess.Popen) -> None:
    """TERM the background run's process group, KILL it if it is still there after a grace period."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def run(command: list[str]) -> int:
    """Run ``command`` beside the background training; return the command's exit status."""
    with tempfile.TemporaryDirectory(prefix="minidist-pretrain-") as tmp:
        log_path = Path(tmp) / "pretrain.log"
        with open(log_path, "w") as log:
            training = start_training(log)
        timed_out = threading.Event()

        def on_timeout() -> None:
            if training.poll() is None:  # a run that finished long ago did not time out
                timed_out.set()
                stop(training)

        watchdog = threading.Timer(TIMEOUT_S, on_timeout)
        watchdog.daemon = True
        watchdog.start()
        command_proc = None
        previous = {}

        def forward(signum, frame) -> None:  # noqa: ANN001
            if command_proc is not None and command_proc.poll() is None:
                command_proc.send_signal(signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, forward)
        try:
            command_proc = subprocess.Popen(command)
            while True:
                try:
                    returncode = command_proc.wait()
                    break
                except KeyboardInterrupt:  # the terminal's Ctrl-C reached the command too: let it end
                    continue
        finally:
            watchdog.cancel()
            still_running = training.poll() is None
            if still_running:
                stop(training)
            if command_proc is not None and command_proc.poll() is None:  # we failed before it ended
                command_proc.kill()
                command_proc.wait()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        report(training.returncode, still_running, timed_out.is_set(), log_path.read_text())
    return returncode


def report(returncode: int, stopped: bool, timed_out: bool, log: str) -> None:
    """One line when the background run succeeded, its log when it failed or was stopped."""
    tail = log[-4000:]
    if timed_out:
        print(
            f"\nbackground training of the pretrained decoder stopped after {TIMEOUT_S} s. Its log:\n{tail}"
        )
    elif stopped:
        print(
            "\nbackground training of the pretrained decoder stopped unfinished "
            "(the command ended first; the next run goes on from scratch)"
        )
    elif returncode != 0:
        print(
            f"\nbackground training of the pretrained decoder FAILED (exit status {returncode}); the tests "
            f"that need the model train it themselves. Its log:\n{tail}"
        )
    else:
        print(f"\n{log.strip().splitlines()[-1] if log.strip() else 'pretrained decoder ready'}")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print(f"usage: {Path(sys.argv[0]).name} -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    returncode = run(argv[1:])
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
