"""Collectives against a single-process reference, torch.distributed, and byte formulas."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import minidist as md
import peer_workers
import shm_workers
import workers
from minidist.collectives import cost_model

ALGORITHMS = ["star", "tree", "ring", "butterfly"]
DTYPES = ["float32", "float64", "bfloat16", "int64"]
OPS = ["sum", "avg", "max", "min"]


def shapes(p: int):
    # numel 0, fewer elements than ranks, not divisible by p, a matrix, a non-contiguous one
    return [
        ((0,), False),
        ((max(p - 1, 1),), False),
        ((7 * p + 3,), False),
        ((10, 33), False),
        ((6, 5), True),
    ]


def reference(kind: str, op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.stack([t.to(torch.float64) if t.is_floating_point() else t for t in inputs])
    if op == "max":
        out = stacked.max(dim=0).values
    elif op == "min":
        out = stacked.min(dim=0).values
    else:
        out = stacked.sum(dim=0)
        if op == "avg":
            p = len(inputs)
            out = out / p if out.is_floating_point() else torch.div(out, p, rounding_mode="floor")
    return out.to(inputs[0].dtype)


def assert_close(got: torch.Tensor, want: torch.Tensor, p: int, what) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=0.05 * p, msg=str(what))
    elif got.is_floating_point():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * p, msg=str(what))
    else:
        assert torch.equal(got, want), what


def allreduce_cases(p: int, algorithms, dtypes=DTYPES, ops=OPS):
    cases = []
    for seed, (shape, noncontig) in enumerate(shapes(p)):
        for algorithm in algorithms:
            for dtype in dtypes:
                for op in ops:
                    cases.append(
                        {
                            "kind": "allreduce",
                            "algorithm": algorithm,
                            "op": op,
                            "dtype": dtype,
                            "shape": shape,
                            "noncontig": noncontig,
                            "seed": seed,
                        }
                    )
    return cases


def check_allreduce(p: int, cases, outs) -> None:
    for i, case in enumerate(cases):
        inputs = [workers.rank_input(case, r) for r in range(p)]
        want = reference("allreduce", case["op"], inputs)
        results = [outs[r][i][0] for r in range(p)]
        for r in range(p):
            assert_close(results[r], want, p, (case, r))
            assert torch.equal(results[r], results[0]), ("ranks disagree", case)  # bit-identical


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
def test_allreduce_every_algorithm_op_dtype_shape_on_shm(world_size):
    cases = allreduce_cases(world_size, ALGORITHMS + ["shm", "auto"])
    outs = md.launch(workers.run_collectives, world_size, args=(cases,), transport="shm", timeout=120)
    check_allreduce(world_size, cases, outs)


@pytest.mark.parametrize("transport", ["pipe", "torch"])
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_allreduce_on_the_other_transports(transport, world_size):
    cases = allreduce_cases(
        world_size, ALGORITHMS + ["auto"], dtypes=["float32", "int64"], ops=["sum", "max"]
    )
    outs = md.launch(workers.run_collectives, world_size, args=(cases,), transport=transport, timeout=120)
    check_allreduce(world_size, cases, outs)


@pytest.mark.parametrize("world_size", [3, 4])
def test_allreduce_matches_torch_distributed_gloo(world_size):
    cases = [
        {"kind": "allreduce", "algorithm": algorithm, "op": op, "dtype": dtype, "shape": (1000,), "seed": 7}
        for algorithm in ALGORITHMS
        for op in ["sum", "max", "min"]
        for dtype in ["float32", "int64"]
    ]
    outs = md.launch(workers.ours_and_gloo, world_size, args=(cases,), transport="torch", timeout=120)
    for r in range(world_size):
        for case, (ours, gloo) in zip(cases, outs[r]):
            assert_close(ours, gloo, world_size, case)


@pytest.mark.parametrize("transport", ["shm", "pipe"])
@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_broadcast_reduce_allgather_reduce_scatter(transport, world_size):
    p = world_size
    cases = []
    for seed, (shape, noncontig) in enumerate(shapes(p)):
        base = {"dtype": "float32", "shape": shape, "noncontig": noncontig, "seed": seed}
        for algorithm in ["star", "tree"]:
            for root in sorted({0, p - 1, p // 2}):
                cases.append({**base, "kind": "broadcast", "algorithm": algorithm, "root": root})
                cases.append({**base, "kind": "reduce", "algorithm": algorithm, "root": root, "op": "sum"})
        cases.append({**base, "kind": "allgather"})
    for op in OPS:
        cases.append({"kind": "reduce_scatter", "op": op, "dtype": "int64", "shape": (2 * p, 3), "seed": 50})
        cases.append({"kind": "reduce_scatter", "op": op, "dtype": "float64", "shape": (p,), "seed": 51})
    cases.append({"kind": "reduce_scatter", "op": "sum", "dtype": "float32", "shape": (0, 4), "seed": 52})
    outs = md.launch(workers.run_collectives, p, args=(cases,), transport=transport, timeout=120)
    for i, case in enumerate(cases):
        inputs = [workers.rank_input(case, r) for r in range(p)]
        for r in range(p):
            got = outs[r][i][0]
            if case["kind"] == "broadcast":
                assert torch.equal(got, inputs[case["root"]]), (case, r)
            elif case["kind"] == "reduce":
                want = reference("reduce", case["op"], inputs) if r == case["root"] else inputs[r]
                assert_close(got, want, p, (case, r))
            elif case["kind"] == "allgather":
                assert torch.equal(got, torch.stack(inputs)), (case, r)
            else:
                rows = case["shape"][0] // p
                want = reference("reduce_scatter", case["op"], inputs)[r * rows : (r + 1) * rows]
                assert_close(got, want, p, (case, r))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 6, 7])
def test_bytes_sent_match_the_formulas(algorithm, world_size):
    p, numel = world_size, 1001
    case = {
        "kind": "allreduce",
        "algorithm": algorithm,
        "op": "sum",
        "dtype": "float32",
        "shape": (numel,),
        "seed": 3,
    }
    outs = md.launch(workers.run_collectives, p, args=([case],), transport="shm", timeout=60)
    n = numel * 4
    sent = [outs[r][0][1]["bytes_sent"] for r in range(p)]
    for r in range(p):  # exactly what the implementation's chunking implies ...
        assert sent[r] == cost_model.bytes_sent(algorithm, p, r, numel, 4), (r, sent)
    # ... and the textbook formulas, up to rounding n/p to whole elements
    rounding = 2 * p * 4
    if algorithm == "ring":
        assert all(abs(s - 2 * (p - 1) / p * n) <= rounding for s in sent)
    elif algorithm == "star":
        assert sent == [(p - 1) * n] + [n] * (p - 1)
    elif algorithm == "tree":
        assert sum(sent) == 2 * (p - 1) * n  # every rank but the root receives once each way
        assert max(sent) <= 2 * math.ceil(math.log2(p)) * n
    else:
        q = 1 << (p.bit_length() - 1)
        folded = 2 * (p - q)
        for r, s in enumerate(sent):
            fold = n if r < folded else 0
            core = 0 if (r < folded and r % 2 == 0) else 2 * (q - 1) / q * n
            assert abs(s - fold - core) <= rounding, (r, s)
    received = sum(outs[r][0][1]["bytes_received"] for r in range(p))
    assert received == sum(sent)


@pytest.mark.parametrize("same_numel", [False, True])
@pytest.mark.parametrize(
    "transport, algorithm", [(t, a) for t in ["shm", "pipe"] for a in ALGORITHMS] + [("shm", "shm")]
)
def test_mismatched_tensors_are_a_clear_error(transport, algorithm, same_numel):
    """Different sizes, and also a (2, 3) against a (3, 2) tensor: same numel, other shape."""
    with pytest.raises(md.WorkerError) as info:
        md.launch(
            workers.mismatched_allreduce, 2, args=(algorithm, same_numel), transport=transport, timeout=30
        )
    assert info.value.exc_type == "MessageMismatch"
    assert "rank" in str(info.value) and "same" in str(info.value)


def test_shm_allreduce_also_catches_a_different_shape_with_the_same_numel():
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.mismatched_allreduce, 2, args=("shm", True), transport="shm", timeout=30)
    assert "shape (2, 3)" in str(info.value) and "shape (3, 2)" in str(info.value)


def test_shm_algorithm_needs_the_shm_transport():
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.mismatched_allreduce, 2, args=("shm", False), transport="pipe", timeout=30)
    assert "transport='shm'" in str(info.value)


@pytest.mark.parametrize("algorithm", ["shm", "ring", "butterfly"])
def test_back_to_back_allreduces_of_changing_sizes(algorithm):
    # small and large (several workspace pieces: > 8 MiB) interleaved
    sizes = [1, 5000, 0, 3_000_000, 17, 40_000, 2_500_001, 3]
    p = 3
    outs = md.launch(workers.allreduce_repeatedly, p, args=(sizes, algorithm), transport="shm", timeout=120)
    want = [float(sum(r + i for r in range(p))) if n else None for i, n in enumerate(sizes)]
    assert outs == [want] * p


def test_reduce_scatter_needs_a_divisible_first_dimension():
    from minidist.transport import ShmComm, share_with_rank
    from minidist.transport.shm_layout import allocate_mailboxes

    shared = allocate_mailboxes(2, chunk=4096, slots=2)
    comm = ShmComm(0, 2, share_with_rank("shm", shared, 0, 2))
    with pytest.raises(ValueError, match="multiple of world_size=2"):
        md.reduce_scatter(comm, torch.ones(3, 2))
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        md.allreduce(comm, torch.ones(2), algorithm="gossip")
    with pytest.raises(ValueError, match="unknown reduction op"):
        md.allreduce(comm, torch.ones(2), op="prod")
    with pytest.raises(ValueError, match="src=5"):
        md.broadcast(comm, torch.ones(2), src=5)
    comm.close()


# --- ranks that disagree: MessageMismatch naming them, never a wrong result or a hang ---
def _disagreements():
    """(transport, world_size, collective, per-rank keyword arguments, the rank that differs)."""
    cases = []

    def two(transport, kind, a, b):
        cases.append((transport, 2, kind, [a, b], 1))

    for algorithm in ["auto", "shm", "star", "tree", "ring", "butterfly"]:
        for shape, dtype in [((4,), "float32"), ((5,), "bfloat16")]:  # numpy and torch small paths
            two(
                "shm",
                "allreduce",
                *[
                    {"op": op, "algorithm": algorithm, "shape": shape, "dtype": dtype}
                    for op in ("sum", "max")
                ],
            )
    two(
        "shm", "allreduce", {"op": "sum", "shape": (300_000,)}, {"op": "min", "shape": (300_000,)}
    )  # in pieces
    two("shm", "allreduce", {"algorithm": "shm"}, {"algorithm": "ring"})
    two("shm", "allreduce", {"algorithm": "butterfly"}, {"algorithm": "auto"})
    cases.append(("shm", 3, "allreduce", [{"op": "sum"}, {"op": "sum"}, {"op": "max"}], 2))
    cases.append(
        ("shm", 3, "allreduce", [{"op": "avg", "algorithm": "ring"}] * 2 + [{"algorithm": "ring"}], 2)
    )
    for transport in ["pipe", "torch"]:
        for algorithm in ["auto", "star", "tree", "ring", "butterfly"]:
            two(
                transport,
                "allreduce",
                {"op": "sum", "algorithm": algorithm},
                {"op": "max", "algorithm": algorithm},
            )
        two(transport, "allreduce", {"algorithm": "ring"}, {"algorithm": "butterfly"})
    for transport in ["shm", "pipe", "torch"]:
        for algorithm in ["star", "tree"]:
            two(
                transport, "broadcast", {"src": 0, "algorithm": algorithm}, {"src": 1, "algorithm": algorithm}
            )
            two(transport, "reduce", {"dst": 0, "algorithm": algorithm}, {"dst": 1, "algorithm": algorithm})
        two(transport, "allgather", {"shape": (4,)}, {"shape": (5,)})
        two(transport, "reduce_scatter", {"shape": (4,)}, {"shape": (6,)})
        two(transport, "all_to_all", {"shape": (2, 3)}, {"shape": (2, 4)})
    two("shm", "reduce", {"op": "sum"}, {"op": "max"})
    two("pipe", "broadcast", {"algorithm": "star"}, {"algorithm": "tree"})
    two("pipe", "reduce_scatter", {"op": "sum"}, {"op": "max"})
    two("torch", "allgather", {"dtype": "float32"}, {"dtype": "float64"})
    cases.append(("pipe", 3, "broadcast", [{"src": 0}, {"src": 0}, {"src": 2}], 2))
    cases.append(("shm", 3, "reduce", [{"dst": 1}, {"dst": 1}, {"dst": 0}], 2))
    return cases


@pytest.mark.parametrize(
    "transport, world_size, kind, per_rank, odd",
    _disagreements(),
    ids=lambda value: None if isinstance(value, list) else str(value),
)
def test_ranks_that_disagree_get_a_mismatch_naming_them(transport, world_size, kind, per_rank, odd):
    """Every collective, algorithm and transport (the shared-memory paths included) refuses
    a disagreement on op, root, algorithm, shape or dtype; the launch timeout turns a hang
    into a LaunchTimeout, which fails this test."""
    with pytest.raises(md.WorkerError) as info:
        md.launch(
            peer_workers.disagreeing_collective,
            world_size,
            args=(kind, per_rank),
            transport=transport,
            timeout=60,
        )
    assert info.value.exc_type == "MessageMismatch", str(info.value)
    assert f"rank {odd}" in info.value.summary and info.value.summary.count("rank ") >= 2, str(info.value)
    assert "same" in info.value.summary  # says what to do


def test_a_plain_allreduce_right_after_an_shm_one_is_not_a_disagreement():
    # a rank still waiting in the shm barrier may already hold a fast peer's first message of
    # the next (ring) allreduce of the same shape: it must not take it for a disagreement
    outs = md.launch(shm_workers.shm_then_plain_same_tensor, 3, args=(150,), transport="shm", timeout=90)
    assert outs == [150, 150, 150]


def test_without_shortcuts_takes_the_point_to_point_path():
    p, numel = 3, 1000
    outs = md.launch(peer_workers.plain_and_shortcut_allreduce, p, args=(numel,), transport="shm", timeout=60)
    want = torch.arange(float(numel)) * sum(r + 1 for r in range(p))
    nbytes = numel * 4
    algorithm = md.collectives.cost_model.fastest_allreduce(p, nbytes, cost_model.DEFAULTS["shm"])
    for rank, out in enumerate(outs):
        assert out["workspace"] and out["same_rank"]
        (plain, plain_bytes), (direct, direct_bytes) = out["plain"], out["direct"]
        assert torch.equal(plain, want) and torch.equal(direct, want)
        assert plain_bytes == cost_model.bytes_sent(algorithm, p, rank, numel, 4)  # messages
        assert direct_bytes == 0  # the shared workspace: no messages at all
        assert "transport='shm'" in out["shm_on_plain"]


# --- the cost model ----------------------------------------------------------------------
def test_cost_formulas_by_hand():
    model = cost_model.AlphaBeta(alpha=1e-5, beta=1e-9, gamma=0.0)
    n = 1e6
    assert cost_model.predict("ring", 4, n, model) == pytest.approx(6e-5 + 1.5e-3)
    assert cost_model.predict("star", 4, n, model) == pytest.approx(6 * (1e-5 + 1e-3))
    assert cost_model.predict("tree", 4, n, model) == pytest.approx(4 * (1e-5 + 1e-3))
    assert cost_model.predict("butterfly", 4, n, model) == pytest.approx(4e-5 + 1.5e-3)
    assert cost_model.predict("butterfly", 5, n, model) == pytest.approx(4e-5 + 1.5e-3 + 2 * (1e-5 + 1e-3))


def test_cost_model_prefers_few_rounds_when_small_and_few_bytes_when_large():
    model = cost_model.AlphaBeta(alpha=5e-5, beta=2e-10)
    assert cost_model.fastest_allreduce(8, 64, model) in ("tree", "butterfly")
    assert cost_model.fastest_allreduce(7, 1 << 28, model) == "ring"
    changes = cost_model.crossovers(7, model, [2**k for k in range(6, 30)])
    assert changes and changes[-1][2] == "ring"


LIB = Path(md.__file__).parents[1]  # the source root, lib/


def test_cost_model_measure_moved_to_bench():
    from minidist.bench.p2p import measure_alpha_beta

    assert callable(measure_alpha_beta)
    with pytest.raises(AttributeError, match="bench.p2p.measure_alpha_beta"):
        cost_model.measure("shm")


def test_alpha_beta_fit_recovers_a_line():
    sizes = [2**k for k in range(10, 24)]
    alpha, beta = cost_model.fit_alpha_beta(sizes, [3e-6 + s * 5e-11 for s in sizes])
    assert alpha == pytest.approx(3e-6) and beta == pytest.approx(5e-11)


# --- the shared-memory allreduce's pipelined path (vectors above 64 KiB, in pieces) ---
def _piece_cases(world_size: int, piece_bytes: int) -> list[dict]:
    """Every dtype and op, at lengths that cross each boundary of the pipelined path: just
    above the small path, whole pieces, one element more, a last piece shorter than the
    number of ranks, and enough pieces that the three stages wrap around several times."""
    from minidist.collectives.shm_allreduce import SMALL_BYTES

    cases = []
    for seed, dtype in enumerate(shm_workers.DTYPES):
        size = shm_workers.DTYPES[dtype].itemsize
        per_piece, small = piece_bytes // size, SMALL_BYTES // size
        pieces = max(4, -(-small // per_piece) + 1)
        lengths = [small + 1, pieces * per_piece, pieces * per_piece + 1]
        lengths += [pieces * per_piece + world_size - 1, (pieces + 3) * per_piece - 1]
        ops = ["max", "min"] if dtype == "bool" else ["sum", "avg"] if dtype == "complex64" else OPS
        for op in ops:
            for n in lengths:
                cases.append({"dtype": dtype, "op": op, "shape": (n,), "seed": seed})
        columns = -(-small // 97) + 2  # a non-contiguous matrix above the small path
        cases.append({"dtype": dtype, "op": ops[0], "shape": (97, columns), "seed": seed, "noncontig": True})
    return cases


@pytest.mark.parametrize("world_size, piece_bytes", [(2, 4096), (3, 4096), (4, 8192), (2, None)])
def test_shm_allreduce_in_pieces_matches_a_single_process_reference(monkeypatch, world_size, piece_bytes):
    """Small pieces (4-8 KiB) put dozens of piece boundaries and stage wrap-arounds into
    tensors of ~100 KiB; the default piece size (None) is checked at a few MiB."""
    from minidist.transport import shm_workspace

    if piece_bytes is None:
        piece_bytes = shm_workspace.PIECE_BYTES
        cases = [
            {"dtype": dtype, "op": op, "shape": (n,), "seed": 1}
            for dtype in ["float32", "bfloat16"]
            for op in ["sum", "max"]
            for n in [piece_bytes // 4 * 3 + 1, piece_bytes // 2 * 5 - 1]
        ]
    else:
        monkeypatch.setattr(shm_workspace, "PIECE_BYTES", piece_bytes)  # read by the launcher
        cases = _piece_cases(world_size, piece_bytes)
    outs = md.launch(
        shm_workers.allreduce_against_reference, world_size, args=(cases,), transport="shm", timeout=180
    )
    for i, case in enumerate(cases):
        for r in range(world_size):
            assert outs[r][i][0], ("differs from the reference", case, r)
            assert outs[r][i][1] == outs[0][i][1], ("ranks differ", case, r)


def test_shm_allreduce_stays_in_step_after_a_small_large_mismatch():
    sizes = [300_000, 5, 700_001, 40_000, 262_145, 1_000_000]
    p = 3
    outs = md.launch(shm_workers.mismatch_then_agree, p, args=(sizes,), transport="shm", timeout=120)
    want = [float(sum(r + i for r in range(p))) for i in range(len(sizes))]
    for error, results in outs:
        assert error is not None and "do not agree" in error
        assert results == want


def test_a_large_shm_allreduce_reports_a_peer_that_left():
    outs = md.launch(shm_workers.large_allreduce_after_peers_left, 2, transport="shm", timeout=60)
    kind, message = outs[0]
    assert kind == "PeerError" and "rank 1" in message, outs[0]


def test_slice_bounds_cover_the_piece_with_cache_line_starts():
    from minidist.collectives.shm_allreduce import slice_bounds

    for numel in [0, 1, 2, 15, 16, 17, 100, 1023, 1024, 1025]:
        for parts in [1, 2, 3, 4, 7]:
            for size in [1, 2, 4, 8, 16]:
                bounds = slice_bounds(numel, parts, size)
                assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
                assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
                assert all(lo <= hi and (lo * size) % 64 == 0 or lo == numel for lo, hi in bounds)
