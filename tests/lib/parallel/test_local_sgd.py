"""Local SGD and DiLoCo (``parallel/local_sgd``) against a one-process reference and formulas.

One launch per world size (2 and 3 ranks, shm) runs every case of ``local_sgd_workers.CASES``;
the tests read its results. References: ``simulate`` (p workers in one process, the outer step
by torch.optim.SGD with Nesterov momentum), DDP and one process on the whole batch (H = 1),
the schedule's rule written out, and ``cost_model.bytes_sent`` / the payload formulas for bytes.
"""

from __future__ import annotations

import pytest
import torch

import local_sgd_workers as w
import minidist as md
from minidist.collectives import cost_model
from minidist.parallel import local_sgd

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module", params=[2, 3], ids=["p2", "p3"])
def run(request):
    p = request.param
    return p, md.launch(w.every_case, p, transport="shm", timeout=60)


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def test_h1_sgd_outer_lr1_no_momentum_equals_ddp_with_sgd(run):
    """Inner SGD, H = 1, outer SGD lr 1 momentum 0 == DDP with SGD == one process on the whole batch.
    (With AdamW inner it would not be: p AdamW updates averaged are not one of the averaged gradient.)"""
    p, outs = run
    want = w.simulate_ddp_sgd(w.CASES["ddp_equal"], p)
    for out in outs:
        close(out["ddp_equal"]["params"], out["ddp"])
        close(out["ddp_equal"]["params"], want)


@pytest.mark.parametrize("name", ["diloco", "streaming", "streaming_now", "streaming_deep", "int8", "nf4"])
def test_every_rank_equals_the_one_process_reference(run, name):
    p, outs = run
    want = w.simulate(w.CASES[name], p)
    for rank, out in enumerate(outs):
        close(out[name]["global_params"], want["global_params"])
        close(out[name]["params"], want["params"][rank])
    # the replicated state is bitwise equal across ranks (same average, same arithmetic)
    assert all(torch.equal(o[name]["global_params"], outs[0][name]["global_params"]) for o in outs)


def test_several_fragments_in_flight_and_pending_at_the_end(run):
    """streaming_deep (H 4, F 4, tau 3: offsets 1, 2, 3, 4, so one launch after every step, each
    applied 3 steps later) exercises what the reference comparison above relies on: 3 exchanges in
    flight at once from step 3 on, and 3 (launched after steps 8, 9, 10) pending at the end (flush)."""
    c = w.CASES["streaming_deep"]
    assert c["fragments"] * c["delay"] > c["H"]
    for out in run[1]:
        assert out["streaming_deep"]["in_flight"] == [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]


def test_the_outer_step_and_schedule_seams_are_used(run):
    """DiLoCo(outer_step=plain SGD, schedule=every fragment every H steps) at momentum 0.9 equals the
    reference of one fragment and momentum 0 (the defaults would give Nesterov, staggered)."""
    p, outs = run
    want = w.simulate(w.case(H=3, fragments=1, mu=0.0, steps=6), p)
    for rank, out in enumerate(outs):
        close(out["seams"]["global_params"], want["global_params"])
        close(out["seams"]["params"], want["params"][rank])
        assert out["seams"]["launched"] == [[3, 6]] * 3


def test_time_to_target_by_hand():
    """Curve reaches 3.0 at step 20; compute 0.1 s a step, one sync of the model 1.0 s."""
    curve = [(0, 5.0), (10, 4.0), (20, 3.0), (30, 2.5)]
    assert local_sgd.steps_to_target(curve, 3.0) == 20
    assert local_sgd.time_to_target(curve, 3.0, 0.1, 1.0) == pytest.approx(20 * 0.1 + 20 * 1.0)  # DDP
    assert local_sgd.time_to_target(curve, 3.0, 0.1, 1.0, inner_steps=10) == pytest.approx(2 + 2 * 1.0)
    # Streaming H 10, F 2, tau 2: launches after 5, 10, 15, 20; each waits 1.0 / 2 - 2 x 0.1 = 0.3
    assert local_sgd.time_to_target(curve, 3.0, 0.1, 1.0, 10, 2, 2) == pytest.approx(2 + 4 * 0.3)
    assert local_sgd.time_to_target(curve, 3.0, 0.1, 1.0, 10, 2, 5) == pytest.approx(2.0)  # all hidden
    assert local_sgd.time_to_target(curve, 2.0, 0.1, 1.0) is None  # never reached
    assert local_sgd.step_compute_s(1000, 10, 6e4) == pytest.approx(1.0)  # 6 N T / rate


def test_local_sgd_replaces_the_parameters_by_their_average(run):
    """LocalSGD (H = 2, AdamW inner) against plain parameter averaging written out in one process."""
    p, outs = run
    want = w.simulate_local_sgd(w.CASES["local_sgd"], p)
    for out in outs:
        close(out["local_sgd"]["params"], want)


def test_each_fragment_syncs_at_its_steps_and_nowhere_else(run):
    p, outs = run
    for name in ("streaming", "streaming_now", "streaming_deep"):
        c = w.CASES[name]
        H, F = c["H"], c["fragments"]
        for out in outs:
            r = out[name]
            for f in range(F):  # the rule written out: offsets (f + 1) H / F, then every H steps
                want = list(range((f + 1) * H // F, c["steps"] + 1, H))
                assert r["launched"][f] == want
                assert r["applied"][f] == [min(t + c["delay"], c["steps"]) for t in want]
    # delay 0: the bytes of step t are exactly the fragments launched after it, nowhere else
    c = w.CASES["streaming_now"]
    for rank, out in enumerate(outs):
        r = out["streaming_now"]
        for t, sent in enumerate(r["sent"], start=1):
            due = [f for f in range(c["fragments"]) if t in r["launched"][f]]
            sizes = [r["bounds"][f][1] - r["bounds"][f][0] for f in due]
            assert sent == sum(cost_model.bytes_sent("ring", p, rank, n, 4) for n in sizes), f"step {t}"
        assert sum(len(launched) for launched in r["launched"]) == 4  # 8 steps, H 4: 2 a fragment
    # the fragments partition the parameters
    bounds = outs[0]["streaming"]["bounds"]
    assert bounds[0][0] == 0 and bounds[-1][1] == outs[0]["streaming"]["params"].numel()
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def test_bytes_per_token_fall_as_one_over_h(run):
    """Counted bytes = (ring bytes of the model per sync) x (syncs) for H in 1, 4, 16; per token
    that is 2(p-1)/p x 4N / H / tokens a step (up to the ring's rounding of N/p)."""
    p, outs = run
    n = outs[0]["H1"]["params"].numel()
    tokens_per_step = p * w.BATCH  # samples stand in for tokens
    per_token = {}
    for rank, out in enumerate(outs):
        for h in (1, 4, 16):
            sent = out[f"H{h}"]["sent"]
            syncs = 16 // h
            assert sum(sent) == syncs * cost_model.bytes_sent("ring", p, rank, n, 4)
            assert [s > 0 for s in sent] == [(t % h) == 0 for t in range(1, 17)]
            per_token[h] = sum(sent) / (16 * tokens_per_step)
            textbook = 2 * (p - 1) / p * 4 * n / h / tokens_per_step
            assert per_token[h] == pytest.approx(textbook, rel=(p - 1) / n + 1e-12)
        assert per_token[1] == pytest.approx(4 * per_token[4]) == pytest.approx(16 * per_token[16])


@pytest.mark.parametrize("quantize", ["int8", "nf4"])
def test_quantized_payload_bytes_equal_the_formula(run, quantize):
    p, outs = run
    n = outs[0][quantize]["params"].numel()
    blocks = -(-n // local_sgd.BLOCK)
    payload = {"int8": blocks * 64 + 4 * blocks, "nf4": blocks * 32 + 4 * blocks}[quantize]
    assert local_sgd.payload_bytes(n, quantize) == payload
    for rank, out in enumerate(outs):
        sent = out[quantize]["sent"]
        syncs = [t for t in range(1, len(sent) + 1) if t % w.CASES[quantize]["H"] == 0]
        assert sent == [(p - 1) * payload if t in syncs else 0 for t in range(1, len(sent) + 1)]
        assert local_sgd.sync_bytes(n, p, rank, quantize) == (p - 1) * payload


def test_outer_step_is_torch_sgd_with_nesterov():
    gen = torch.Generator().manual_seed(0)
    theta, deltas = torch.randn(10, generator=gen), torch.randn(3, 10, generator=gen)
    ours, momentum = theta.clone(), torch.zeros(10)
    ref = torch.nn.Parameter(theta.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for delta in deltas:
        local_sgd.nesterov_outer_step_(ours, momentum, delta, 0.7, 0.9)
        ref.grad = delta.clone()
        opt.step()
        close(ours, ref.detach())


def test_schedule_timeline_is_the_docstring_picture():
    assert local_sgd.fragment_offsets(8, 4) == [2, 4, 6, 8]
    assert local_sgd.timeline(4, 2, 1, 9).splitlines()[1:] == [
        "fragment 0          L---A           L---A",
        "fragment 1                  L---A           L---A",
    ]
    assert "L---A" in local_sgd.schedule.__doc__


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(inner_steps=0), "inner_steps must be >= 1"),
        (dict(inner_steps=4, fragments=5), "fragments must lie in 1..inner_steps=4"),
        (dict(inner_steps=4, delay=4), "delay must lie in 0..inner_steps-1=3"),
        (dict(quantize="fp8"), "quantize must be one of"),
        (dict(mix=1.0), r"mix must lie in \[0, 1\)"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs, match):
    model = w.make_model(0)
    with pytest.raises(ValueError, match=match):
        local_sgd.DiLoCo(model, None, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
