"""The case table of assignment 2 (async parameter server, Hogwild). Instructors only.

Every test is a ``Case`` of ``cases(seed)``: a job (a worker of ``workers.py``, a number of
ranks, JSON arguments) and a trusted check of what the ranks report. pytest runs them with
seed 0; ``grading.py`` runs the same cases with a seed per student. The student's server is
tested with trusted workers, the student's workers with a trusted server (``workers.py``), so
each task earns its points alone, and a protocol bug shows on the side that has it:

* one worker: staleness is always 0 and the result must equal the single-process loop;
* "lockstep" trusted workers fix the order of pushes, so the student's server must give
  exactly the replayed table, gradsq and staleness (0, 1, ..., W - 1 in every round);
* the trusted server logs the order it applied the student's workers' pushes in; the run is
  replayed from that log and must match exactly;
* free-running workers: every push applied once, staleness consistent with the versions the
  workers pulled, the loss close to the single-process loop's;
* Hogwild: one rank equals the loop; ranks whose parts share no row are exact; else converge.

The folder holding the student's ``async_ps.py`` must be on PYTHONPATH; it is imported only in
the worker processes. Each ``Case`` carries its points; ``grading.py`` declares the assignment.
"""

from __future__ import annotations

from grader.assignment import Case
from grader.tiers import Tiers

from . import reference as ref

TASKS = {
    "staleness_aware_lr": 1,
    "run_server": 1,
    "ps_worker": 2,
    "hogwild_worker": 3,
    "prefetching_worker": 4,
}

#: the measured test's data and configuration: the same for every student (a leaderboard compares them)
MEASURED_DATA = {"seed": 2026, "vocab": 40, "tokens": 800, "window": 4}
MEASURED_CONFIG = {"dim": 8, "lr": 0.1, "batch_size": 16, "epochs": 3, "seed": 0}
MEASURED_TIERS = Tiers(
    quantity="emulated worker time / max(compute, link busy)",
    unit="x",
    levels=((1.1, 1.0), (1.4, 0.5), (2.5, 0.25)),
    lower_is_better=True,
    baseline="the library's worker (pull, wait, compute, push) reaches 1.86x",
)


def data(seed: int, base: int, **extra) -> dict:
    return {"seed": seed * 1000 + base, "vocab": 40, "tokens": 800, "window": 4, **extra}


def config(seed: int, batch_size: int = 16, epochs: int = 3) -> dict:
    return {"dim": 8, "lr": 0.1, "batch_size": batch_size, "epochs": epochs, "seed": seed % 1000}


# --- the cases ---------------------------------------------------------------------------------
def cases(seed: int) -> list[Case]:
    lr_cases = [[0.1, 0], [0.1, 1], [0.1, 2], [0.05, 3], [0.1, 7], [1.0, 100], [0.3, 1], [0.02, 5]]
    out = [
        Case(
            "test_staleness_aware_lr",
            2,
            "staleness_aware_lr",
            "lr_values",
            1,
            [lr_cases],
            ref.lr_check(lr_cases),
        )
    ]

    def ps(name, points, function, parts, d, c, server, worker, check, transport="shm"):
        out.append(
            Case(
                name,
                points,
                function,
                "parameter_server",
                parts + 1,
                [d, c, server, worker],
                check,
                transport,
            )
        )

    d, c = data(seed, 1), config(seed)
    what = "run_server with one trusted worker"
    ps(
        "test_server_with_one_worker_is_the_loop",
        3,
        "run_server",
        1,
        d,
        c,
        "student",
        "reference",
        ref.sequential_check(what, d, c, "server"),
    )
    for parts in (2, 3):
        d, c = data(seed, 10 + parts, tokens=500), config(seed, batch_size=13, epochs=2)
        check = ref.lockstep_check(f"run_server with {parts} lockstep trusted workers", d, c, parts)
        ps(f"test_server_lockstep[{parts}]", 3, "run_server", parts, d, c, "student", "lockstep", check)
    d, c = data(seed, 20), config(seed)
    check = ref.free_check("run_server with 3 free-running trusted workers", d, c, 3, True)
    ps("test_server_free_running", 2, "run_server", 3, d, c, "student", "reference", check)
    d, c = data(seed, 21, tokens=400), config(seed, batch_size=13, epochs=2)
    check = ref.lockstep_check("run_server with 2 lockstep trusted workers, transport 'pipe'", d, c, 2)
    ps("test_server_pipe_transport", 1, "run_server", 2, d, c, "student", "lockstep", check, "pipe")

    d, c = data(seed, 30), config(seed)
    check = ref.sequential_check("ps_worker alone with the trusted server", d, c, "worker")
    ps("test_worker_alone_is_the_loop", 3, "ps_worker", 1, d, c, "reference", "student", check)
    for parts in (2, 3):
        d, c = data(seed, 30 + parts, tokens=500), config(seed, batch_size=13, epochs=2)
        check = ref.replay_check(f"{parts} ps_workers with the trusted server", d, c, parts)
        ps(f"test_workers_replayed[{parts}]", 3, "ps_worker", parts, d, c, "reference", "student", check)
    d, c = data(seed, 34, tokens=400), config(seed, batch_size=13, epochs=2)
    check = ref.replay_check("2 ps_workers with the trusted server, transport 'pipe'", d, c, 2)
    ps("test_workers_pipe_transport", 1, "ps_worker", 2, d, c, "reference", "student", check, "pipe")

    d, c = data(seed, 40), config(seed)
    check = ref.sequential_check("run_server with one ps_worker (both yours)", d, c, "worker")
    ps("test_server_and_workers[1]", 2, "run_server", 1, d, c, "student", "student", check)
    d, c = data(seed, 41), config(seed)
    check = ref.free_check("run_server with 3 ps_workers (all yours)", d, c, 3, False)
    ps("test_server_and_workers[3]", 2, "run_server", 3, d, c, "student", "student", check)

    d, c = data(seed, 60, tokens=500), config(seed, batch_size=13, epochs=2)
    check = ref.replay_check("prefetching_worker with the trusted server", d, c, 1)
    ps("test_prefetching_worker_replayed", 2, "prefetching_worker", 1, d, c, "reference", "prefetch", check)
    what = "prefetching_worker on the emulated clock"
    out.append(
        Case(
            "test_prefetching_worker_time",
            6,
            "prefetching_worker",
            "parameter_server",
            2,
            [MEASURED_DATA, MEASURED_CONFIG, "reference", "prefetch"],
            ref.prefetch_check(what, MEASURED_DATA, MEASURED_CONFIG),
            "pipe",
            MEASURED_TIERS,
        )
    )
    for name, ranks, groups, exact, points in [
        ("test_hogwild_one_rank_is_the_loop", 1, 1, True, 2),
        ("test_hogwild_disjoint_parts_are_exact[2]", 2, 2, True, 2),
        ("test_hogwild_disjoint_parts_are_exact[4]", 4, 4, True, 2),
        ("test_hogwild_converges", 2, 1, False, 2),
    ]:
        d, c = data(seed, 50 + ranks + 10 * exact, groups=groups), config(seed)
        check = ref.hogwild_check(f"hogwild_worker on {ranks} rank(s)", d, c, ranks, exact)
        out.append(Case(name, points, "hogwild_worker", "hogwild", ranks, [d, c], check))
    return out
