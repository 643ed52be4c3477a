"""Pipeline parallelism: schedules against a brute-force checker and the bubble formula, and the
executor against one process.

References: the bubble (p - 1) / (v m + p - 1) of GPipe / 1F1B / interleaved 1F1B (Huang et al.
2019; Narayanan et al. 2021), the 1F1B warm-up of p - 1 - r forwards, and ``DecoderLM`` run in
one process on the whole batch (loss and every gradient, float64).
"""

from __future__ import annotations

import pytest
import torch

import minidist as md
import pipeline_workers as w
from minidist.models import stages
from minidist.parallel import pipeline as pp

pytestmark = pytest.mark.timeout(180)

CASES = [(p, m) for p in range(1, 6) for m in range(1, 11)]


# --- schedules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule_fn", [pp.gpipe, pp.one_f_one_b])
def test_schedules_pass_the_checker_and_match_the_bubble_formula(schedule_fn):
    for p, m in CASES:
        schedule = schedule_fn(p, m)
        pp.check_schedule(schedule, m)
        tl = pp.simulate(schedule, t_forward=1.0, t_backward=2.0)
        assert tl.bubble_fraction == pytest.approx(pp.bubble_formula(p, m), abs=1e-12), (p, m)
        assert tl.makespan == pytest.approx((m + p - 1) * 3.0), (p, m)


def test_interleaved_passes_the_checker_and_matches_the_paper_bubble():
    for p in range(1, 5):
        for v in (1, 2, 3):
            for m in range(p, 13, p):
                schedule = pp.interleaved_one_f_one_b(p, m, v)
                pp.check_schedule(schedule, m)
                bubble = pp.simulate(schedule, 1.0, 2.0).bubble_fraction
                # the paper: bubble time (p - 1)(t_f + t_b) / v against m (t_f + t_b) of work
                assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)
    assert pp.bubble_formula(4, 8, 2) < pp.bubble_formula(4, 8)
    with pytest.raises(ValueError, match="6 microbatches is not a multiple of 4"):
        pp.interleaved_one_f_one_b(4, 6, 2)


def test_one_f_one_b_warms_up_with_p_minus_1_minus_r_forwards():
    for p, m in CASES:
        for r, actions in enumerate(pp.one_f_one_b(p, m)):
            kinds = [a[0] for a in actions]
            assert kinds.index("B") == min(p - 1 - r, m - 1) + 1, (p, m, r)
            steady = kinds[kinds.index("B") - 1 :]  # after warm-up: F B F B ... then only B
            n_steady = m - min(p - 1 - r, m)
            assert steady[: 2 * n_steady] == ["F", "B"] * n_steady


def test_peak_in_flight_gpipe_m_1f1b_p_minus_r():
    for p, m in CASES:
        assert pp.peak_in_flight(pp.gpipe(p, m)) == [m] * p
        assert pp.peak_in_flight(pp.one_f_one_b(p, m)) == [min(p - r, m) for r in range(p)]


@pytest.mark.parametrize(
    "schedule, message",
    [
        ([[("F", 0), ("B", 0)], [("F", 0)]], r"stage 1: B0 is missing"),
        ([[("F", 0), ("F", 0), ("B", 0)], [("F", 0), ("B", 0)]], r"stage 0: F0 appears twice"),
        ([[("F", 0), ("B", 0), ("F", 2)], [("F", 0), ("B", 0)]], r"stage 0: F2 names microbatch 2"),
        ([[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]], r"stage 1: B0 comes before its own forward"),
        # stage 0 waits for B0 before sending F1; stage 1 wants F1 before F0: each waits on the other
        (
            [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]],
            r"deadlock: stage 0 waits in B0 for B0 on stage 1; stage 1 waits in F1 for F1 on stage 0",
        ),
        # a backward on stage 0 before the last stage has even run the forward
        ([[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("B", 1), ("F", 0), ("B", 0)]], r"deadlock"),
        ([[("F", 0), ("B", 0)], [("X", 0)]], r"stage 1: action \('X', 0\) is not"),
    ],
)
def test_checker_names_the_first_violation(schedule, message):
    m = 2 if any(a[1] == 1 for row in schedule for a in row if len(a) > 1 and a[0] != "X") else 1
    with pytest.raises(pp.ScheduleError, match=message):
        pp.check_schedule(schedule, m)


def test_checker_catches_a_swapped_chunk_in_interleaved():
    schedule = pp.interleaved_one_f_one_b(2, 2, 2)
    row = schedule[1]
    i, j = row.index(("F", 0, 0)), row.index(("F", 0, 1))
    row[i], row[j] = row[j], row[i]  # chunk 1 before the chunk 0 that feeds it (via stage 0)
    with pytest.raises(pp.ScheduleError, match="deadlock"):
        pp.check_schedule(schedule, 2)


def test_draw_ascii_and_plot_timeline():
    p, m = 3, 4
    text = pp.draw_ascii(pp.gpipe(p, m))
    rows = text.splitlines()
    assert len(rows) == p
    for r, row in enumerate(rows):
        cells = row.split("|", 1)[1].split()
        assert cells[:r] == ["."] * r and cells[r] == "F0"  # stage r starts r slots late
        assert cells.count("F3") == 1 and cells.count("B3") == 2  # a backward is two forward slots
    import matplotlib

    matplotlib.use("Agg")
    ax = pp.plot_timeline(pp.simulate(pp.one_f_one_b(p, m)))
    assert len(ax.get_yticks()) == p
    assert "bubble" in ax.get_title()


# --- stages -------------------------------------------------------------------------------------


def test_split_decoder_chained_in_one_process_equals_the_model():
    model = w.tiny_model()
    ids = w.batch(4)
    want = model(ids, labels=ids)
    for p, chunks in [(1, 1), (2, 1), (4, 1), (2, 2)]:
        parts = stages.split_decoder(model, p, chunks)
        virtual = [parts[s % p][s // p] if chunks > 1 else parts[s] for s in range(p * chunks)]
        x = ids
        for stage in virtual:
            x = stage(x)
        torch.testing.assert_close(x, want.logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(stages.next_token_loss(x, ids), want.loss, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="4 layers do not split evenly into 3 stages"):
        stages.split_decoder(model, 3)


def test_run_pipeline_refuses_bad_input_before_talking():
    class OneRank:
        rank, world_size = 0, 1

    module = stages.split_decoder(w.tiny_model(), 1)[0]
    with pytest.raises(ValueError, match="a batch of 6 does not split into 4 equal microbatches"):
        pp.run_pipeline(module, OneRank(), pp.gpipe(1, 4)[0], w.batch(6), w.batch(6), stages.next_token_loss)
    with pytest.raises(ValueError, match="needs loss_fn"):
        pp.run_pipeline(module, OneRank(), pp.gpipe(1, 4)[0], w.batch(8), w.batch(8))


# --- the executor -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "names, p, m, chunks",
    [(["gpipe", "1f1b"], 2, 4, 1), (["gpipe", "1f1b"], 4, 8, 1), (["interleaved"], 2, 4, 2)],
)
def test_pipeline_step_equals_one_process(names, p, m, chunks):
    batch = 8
    runs = md.launch(w.pipeline_steps, p, args=(names, m, batch, chunks), transport="shm", timeout=120)
    want_loss, want_grads = w.reference(batch)
    for name in names:
        check_step([run[name] for run in runs], name, p, m, chunks, want_loss, want_grads)


def check_step(outs, name, p, m, chunks, want_loss, want_grads):
    assert outs[-1]["loss"] == pytest.approx(want_loss, rel=1e-12)
    assert all(o["loss"] is None for o in outs[:-1])
    grads = {}
    for o in outs:
        for key, g in o["grads"].items():
            if key in grads:  # the tied table: both copies hold the summed gradient
                torch.testing.assert_close(g, grads[key], rtol=0, atol=0)
            grads[key] = g
    assert grads.keys() == want_grads.keys()
    for key in want_grads:
        torch.testing.assert_close(
            grads[key], want_grads[key], rtol=1e-10, atol=1e-12, msg=lambda s: f"{name} {key}: {s}"
        )

    schedule = w.schedule_of(name, p, m, chunks)
    peaks = [o["peak"] for o in outs]
    assert peaks == pp.peak_in_flight(schedule)
    if name == "gpipe":
        assert peaks == [m] * p
    if name == "1f1b":
        assert peaks == [p - r for r in range(p)]

    # measured order: each rank ran its list, and every dependency ended before its user started
    ends = {}
    for r, o in enumerate(outs):
        ran = [tuple(a) + (0,) * (3 - len(a)) for a, _, _ in o["actions"]]
        assert ran == [tuple(a) + (0,) * (3 - len(a)) for a in schedule[r]]
        for a, (_, start, end) in zip(ran, o["actions"], strict=True):
            ends[(r, a)] = end
            assert start <= end
    for r, o in enumerate(outs):
        for a, start, _ in o["actions"]:
            a = tuple(a) + (0,) * (3 - len(a))
            for dep in pp.simulator._dependencies(a, r, p, chunks):
                assert ends[dep] <= start, (r, a, dep)


def test_a_crashed_stage_is_reported_not_a_hang():
    with pytest.raises(md.WorkerError, match="stage 1 crashed on purpose"):
        md.launch(w.crashing_stage, 2, transport="shm", timeout=60, forward_output=False)


def test_a_deadlocking_schedule_times_out_with_the_stuck_ranks():
    with pytest.raises(md.LaunchTimeout, match=r"ranks \[0, 1\]"):
        md.launch(w.deadlocked, 2, transport="shm", timeout=5, forward_output=False)


def test_measure_bubble_runs_the_schedule_it_was_given():
    # no timing assertion (machines are noisy): the measured run follows the schedule
    p, m = 2, 3
    r = pp.measure_bubble(p, m, pp.one_f_one_b, t_forward=0.001, t_backward=0.002, timeout=60)
    schedule = pp.one_f_one_b(p, m)
    assert [[a for a, _, _ in row] for row in r["timeline"].stages] == schedule
    assert [o.peak_in_flight for o in r["results"]] == pp.peak_in_flight(schedule)
    assert r["formula"] == pp.bubble_formula(p, m) == pytest.approx(r["simulated"])
    assert r["measured"] == pytest.approx(r["timeline"].bubble_fraction)


def test_tied_gradients_summed_when_one_rank_holds_both_copies():
    class OneRank:
        rank, world_size = 0, 1

    model = w.tiny_model()
    ids = w.batch(4)
    model(ids, labels=ids).loss.backward()
    chunks = stages.split_decoder(w.tiny_model(), 1, 2)[0]  # embeddings in chunk 0, a copy of E in chunk 1
    stages.next_token_loss(chunks[1](chunks[0](ids)), ids).backward()
    stages.sync_tied_gradients(chunks, OneRank())
    want = model.word_embeddings.grad
    torch.testing.assert_close(chunks[0].embeddings.word.weight.grad, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(chunks[1].head.grad, want, rtol=1e-10, atol=1e-12)
