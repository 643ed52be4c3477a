"""Where was each rank stuck? Python stacks from workers, via faulthandler on SIGUSR1."""

from __future__ import annotations

import contextlib
import os
import signal
import time


def collect_stacks(processes, ranks, stack_files) -> dict[int, str]:
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(processes[rank].pid, signal.SIGUSR1)
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline and len(stacks) < len(ranks):
        time.sleep(0.05)
        for rank in ranks:
            with contextlib.suppress(OSError):
                text = open(stack_files[rank]).read()
                if text.strip() and rank not in stacks:
                    time.sleep(0.05)  # let faulthandler finish writing
                    stacks[rank] = _tidy_stack(open(stack_files[rank]).read())
    return stacks


def _tidy_stack(text: str) -> str:
    """Keep what helps a student: frames from fn down; drop launcher plumbing and idle threads."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")) and current:
            blocks.append(current)
            current = []
        current.append(line)
    if current:
        blocks.append(current)
    kept = []
    for block in blocks:
        frames = []
        for line in block:
            if " in _worker_main" in line:
                break
            frames.append(line)
        body = "\n".join(frames)
        idle_queue_thread = "queues.py" in body and " in _run" in body and " in _do_" not in body
        if idle_queue_thread or (len(frames) > 1 and "minidist-output" in body):
            continue
        kept.append(body)
    return "\n".join(kept) if kept else text
