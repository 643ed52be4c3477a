"""torchrun's own fault tolerance, the existing engine across machines: two agents ("nodes") on
127.0.0.1 with a c10d rendezvous and ``--max-restarts=1``. A worker is SIGKILLed at step 2; its
peer's gloo receive raises (PeerError, no hang), both agents restart their workers in a new
rendezvous round, and training resumes from the checkpoint saved after each step.

``--nnodes=2:2`` (MIN:MAX with MIN = MAX): a first try with ``1:2`` did not finish within 150 s
on this machine (not investigated; with MIN < MAX a round may close with the first agent alone,
after ``last_call_timeout``, and a second agent's arrival restarts the workers again).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


@pytest.mark.timeout(180)
def test_torchrun_restarts_every_worker_and_training_resumes_from_the_checkpoint(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "MINIDIST_TEST_OUT": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([HERE, os.path.join(REPO, "lib")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:2", "--nproc-per-node=1",
               "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=minidist-elastic-test", "--monitor-interval=0.1",
               os.path.join(HERE, "elastic_torchrun_job.py")]  # fmt: skip
    nodes = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )  # fmt: skip
        for _ in (0, 1)
    ]
    try:
        for node in nodes:
            out, _ = node.communicate(timeout=150)
            assert node.returncode == 0, out
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # w after 4 steps of w -= 0.1 * mean over ranks r = 0, 1 of (r + 1 + step): -0.1 * sum(1.5 + s)
    want = -0.1 * sum(1.5 + s for s in range(4))
    for rank in (0, 1):
        outs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for out in outs:
            assert out["attempt"] == 1 and out["start"] == 2  # restarted once, resumed at step 2
            assert out["w"] == pytest.approx([want] * 3, abs=1e-12)
