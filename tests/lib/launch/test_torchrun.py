"""The same worker function under torchrun, two node groups ("machines") on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import minidist as md
from conftest import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))


@pytest.mark.timeout(180)
def test_two_torchrun_node_groups_run_one_job(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "MINIDIST_TEST_OUT": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([HERE, os.path.join(REPO, "lib")]),
        "OMP_NUM_THREADS": "1",
    }
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                os.path.join(HERE, "torchrun_job.py"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            out, _ = node.communicate(timeout=150)
            outputs.append(out)
            assert node.returncode == 0, out
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
                node.wait()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    gathered = results[0]
    assert all(r == gathered for r in results)  # every rank got every rank's result
    assert [g["rank"] for g in gathered] == [0, 1, 2, 3]
    assert [g["local_rank"] for g in gathered] == [0, 1, 0, 1]  # two per "machine"
    assert all(g["world_size"] == 4 for g in gathered)
    assert [g["got"] for g in gathered] == [3.0, 0.0, 1.0, 2.0]  # from the previous rank in the ring


def test_world_size_must_agree_with_torchrun(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ValueError, match="WORLD_SIZE=4"):
        md.launch(print, 2)
