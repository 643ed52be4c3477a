"""Who averages the gradients: central PS, sharded PS, ring, BytePS -- all equal to one process.

Each architecture runs as a DDP comm hook in one md.launch (workers + server processes);
the result after several AdamW steps is compared with ``ddp_workers.train_single`` (one
process, the whole batch), and the bytes every process moved with the formulas.
"""

from __future__ import annotations

import pytest
import torch

import averaging_workers as aw
import ddp_workers as w
import minidist as md
from minidist.parallel import averaging
from minidist.parallel.group import SubComm

pytestmark = pytest.mark.timeout(240)

CASES = {
    # id: (architecture, workers, summation servers, transport)
    "central-p2-shm": ("central", 2, 0, "shm"),
    "central-p3-pipe": ("central", 3, 0, "pipe"),
    "sharded-p3-shm": ("sharded", 3, 0, "shm"),
    "ring-p2-pipe": ("ring", 2, 0, "pipe"),
    "byteps-p2-k1-pipe": ("byteps", 2, 1, "pipe"),
    "byteps-p3-k2-shm": ("byteps", 3, 2, "shm"),
    "byteps-p3-k0-pipe": ("byteps", 3, 0, "pipe"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_architecture_equals_one_process_and_bytes_match_formula(case):
    arch, n, k, transport = CASES[case]
    cfg = w.config(world_size=n, steps=3, bucket_mb=w.SEVERAL_BUCKETS_MB)
    servers = averaging.servers_for(arch, k)
    outs = md.launch(
        aw.train_with_architecture,
        world_size=n + servers,
        args=(cfg, arch, k),
        transport=transport,
        timeout=150,
    )
    want = w.train_single(cfg)
    workers = [o for o in outs if o["role"] == "worker"]
    assert len(workers) == n and len(outs) - n == servers
    assert len(workers[0]["numels"]) == 2  # several buckets: each a round of its own
    for out in workers:
        for name in want:
            torch.testing.assert_close(out["state"][name], want[name], rtol=1e-5, atol=1e-6)
    if arch == "ring":
        return
    expected = averaging.expected_bytes(workers[0]["numels"], arch, n, k)
    steps = cfg["steps"]
    for r, out in enumerate(workers):
        sent, received = expected[f"worker {r}"]
        assert (out["stats"]["bytes_sent"], out["stats"]["bytes_received"]) == (
            steps * sent,
            steps * received,
        )
    for s, out in enumerate(outs[n:]):
        sent, received = expected[f"server {s}"]
        assert out["rounds"] == steps * len(workers[0]["numels"])
        stop_headers = n * averaging.HEADER_BYTES
        assert (out["stats"]["bytes_sent"], out["stats"]["bytes_received"]) == (
            steps * sent,
            steps * received + stop_headers,
        )


def test_byteps_share_is_the_papers_optimum():
    """x = 2k(n-1)/(n^2+kn-2k) balances a worker's and a server's bytes sent; k=0 is allreduce, k=n a PS."""
    assert averaging.byteps_server_share(4, 0) == 0.0
    assert averaging.byteps_server_share(4, 4) == 1.0
    assert averaging.byteps_server_share(4, 9) == 1.0  # capped: more servers than workers
    for n in (2, 3, 4, 8):
        for k in range(1, n + 1):
            x = averaging.byteps_server_share(n, k)
            worker_sends = x + 2 * (n - 1) / n * (1 - x)
            server_sends = n * x / k
            assert worker_sends == pytest.approx(server_sends)
            assert worker_sends == pytest.approx(2 * n * (n - 1) / (n * n + k * n - 2 * k))


@pytest.mark.parametrize("n", [3, 4])
def test_byteps_worker_bytes_shrink_and_central_server_grows_with_n(n):
    numels = [10_000]
    worker_sent = [averaging.expected_bytes(numels, "byteps", n, k)["worker 0"][0] for k in range(n + 1)]
    assert all(a > b for a, b in zip(worker_sent, worker_sent[1:]))
    assert worker_sent[0] == averaging.expected_bytes(numels, "sharded", n)["worker 0"][0]
    central = [averaging.expected_bytes(numels, "central", m)["server 0"] for m in (2, 3, 4)]
    assert [sent for sent, _ in central] == [m * 40_000 for m in (2, 3, 4)]


def test_partition_covers_every_element_once():
    for numel in (0, 1, 5, 117, 1000):
        for servers, share in (([], 0.0), ([3], 1.0), ([3, 4], 0.4), ([3, 4], 0.999)):
            pieces = averaging.partition(numel, [0, 1, 2], servers, share)
            covered = sorted(i for p in pieces for i in range(p.start, p.stop))
            assert covered == list(range(numel))


def test_group_view_renumbers_ranks_and_runs_collectives():
    outs = md.launch(aw.group_collectives, world_size=4, args=([0, 2, 3],), transport="shm", timeout=60)
    assert outs[1]["member"] is False and outs[1]["stats"]["bytes_sent"] == 0
    members = [outs[r] for r in (0, 2, 3)]
    assert [m["group_rank"] for m in members] == [0, 1, 2]
    for m in members:
        torch.testing.assert_close(m["sum"], torch.full((5,), 1.0 + 3.0 + 4.0))
        torch.testing.assert_close(m["bcast"], torch.full((3,), 2.0))  # group rank 1 is full rank 2
        torch.testing.assert_close(m["async"], torch.full((4,), 0.0 + 1.0 + 2.0))


def test_bad_arguments_say_what_to_do():
    from test_ddp import SoloComm

    with pytest.raises(ValueError, match="unknown architecture"):
        averaging.servers_for("gossip", 0)
    with pytest.raises(ValueError, match="needs 1 server"):
        averaging.make_hook("central", SoloComm(), 1)
    with pytest.raises(ValueError, match="server_share"):
        averaging.partition(10, [0], [], 0.5)
    solo = SoloComm()
    solo.world_size = 2
    with pytest.raises(ValueError, match="not in the group"):
        SubComm(solo, [1])


def test_link_time_model_of_central_and_ring():
    alpha, bandwidth, numel, n = 1e-5, 1e9, 1000, 3
    central = averaging.push_pull_seconds([numel], "central", n, 0, alpha, bandwidth)
    push = 2 * alpha + (4 * numel + averaging.HEADER_BYTES) / bandwidth  # header + bucket to the server
    pull = n * (alpha + 4 * numel / bandwidth)  # the server answers n workers, one after another
    assert central == pytest.approx(push + pull)
    ring = averaging.push_pull_seconds([numel], "ring", n, 0, alpha, bandwidth)
    assert ring == pytest.approx(2 * (n - 1) * (alpha + 4 * numel / n / bandwidth))
