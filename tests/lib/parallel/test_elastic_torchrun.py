"""torchrun's own fault tolerance, the existing engine across machines: two agents ("nodes") on
127.0.0.1 with a c10d rendezvous, ``--nnodes=1:2`` and ``--max-restarts=2``, one launch that
loses first a worker, then a whole node (see elastic_torchrun_job.py):

- step 2: a worker is SIGKILLed; its peer's gloo receive raises (PeerError, no hang), both
  agents restart their workers in a new rendezvous round, at world size 2 again, and training
  resumes from the ``minidist.checkpoint`` saved at the top of step 2;
- step 4: an *agent* and its worker are SIGKILLed (a machine lost); the other agent restarts its
  worker, the rendezvous closes a round with one node (MIN = 1) once the dead agent's heartbeats
  have expired (``keep_alive_interval`` x ``keep_alive_max_attempt`` = 2 s) and
  ``last_call_timeout`` (3 s; also the time the second agent has to join the first round) has
  passed, and the worker loads the 2-rank ZeRO-3 checkpoint of step 4 at world size 1
  (resharded 2 -> 1) and finishes.

The store is hosted by the agent that is not killed (``is_host``); the killed agent is started
with MINIDIST_DIE_AT=4. Needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see below): without it about
one restart in three hung here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.timeout(180)
def test_torchrun_restarts_after_a_worker_and_a_node_die_and_reshards_the_checkpoint(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "MINIDIST_TEST_OUT": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([HERE, os.path.join(REPO, "lib")]),
        "OMP_NUM_THREADS": "1",
        # without it a restarted worker may read its peer's address of the previous attempt from
        # the rendezvous store torchrun shares with the workers and hang (pytorch/pytorch#135712)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    conf = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=60"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
               "--max-restarts=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=minidist-elastic-test", "--monitor-interval=0.1"]  # fmt: skip
    job = os.path.join(HERE, "elastic_torchrun_job.py")
    nodes = [
        subprocess.Popen(
            [*command, f"--rdzv-conf={conf},is_host={host}", job],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, **extra},
            start_new_session=True,
        )
        for host, extra in (("true", {}), ("false", {"MINIDIST_DIE_AT": "4"}))
    ]
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "die.json").exists():  # the machine to lose has reached step 4
            assert time.monotonic() < deadline and nodes[1].poll() is None, nodes[1].communicate()[0]
            time.sleep(0.05)
        die = json.loads((tmp_path / "die.json").read_text())
        assert die["agent"] == nodes[1].pid
        _kill(die["agent"])
        _kill(die["worker"])
        out, _ = nodes[0].communicate(timeout=120)
        assert nodes[0].returncode == 0, out
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pids = tmp_path / "pids"  # torchrun's workers run in their own sessions
        for pid in pids.read_text().split() if pids.exists() else []:
            _kill(int(pid))
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    got = sorted((s["start"], s["world"], s["restart"]) for s in starts if s["rank"] == 0)
    # rank 0's attempts: at size 2 from step 0, after the worker's death at size 2 from the
    # checkpoint of step 2, after the node's death at size 1 from the checkpoint of step 4
    assert [(start, world) for start, world, _ in got] == [(0, 2), (2, 2), (4, 1)], got
    # torchrun's restart count is its agent's: an agent that sees the membership change before its
    # own worker fails restarts without counting one, and which agent holds rank 0 after a
    # re-rendezvous varies (seen in CI: 0, 0, 1 as well as 0, 1, 2)
    restarts = [restart for _, _, restart in got]
    assert restarts[0] == 0 and restarts == sorted(restarts) and restarts[-1] >= 1, got
    assert len(starts) == 5  # rank 1 twice at size 2, then gone
    # w after 6 steps of w -= 0.1 * mean over the ranks r of (r + 1 + step): 2 ranks for steps
    # 0-3 (mean 1.5 + step), 1 rank for steps 4-5 (1 + step)
    want = -0.1 * (sum(1.5 + s for s in range(4)) + sum(1 + s for s in (4, 5)))
    outs = json.loads((tmp_path / "rank0.json").read_text())
    assert len(outs) == 1 and outs[0]["start"] == 4
    assert outs[0]["w"] == pytest.approx([want] * 3, abs=1e-12)
