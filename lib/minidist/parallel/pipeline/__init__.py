"""Pipeline parallelism: a model cut into p stages, one per rank; a batch cut into m microbatches.

One idea per module; read them in this order:

    schedules.py   the schedules as data: GPipe, 1F1B, interleaved 1F1B, the bubble formula,
                   the activations each stage holds. Pure functions: start here.
    simulator.py   check a schedule (missing, repeated, out-of-order actions, deadlocks) and
                   simulate it on an ideal machine: a Timeline with its bubble
    drawing.py     a Timeline as text (draw_ascii) or as bars (plot_timeline)
    executor.py    run_pipeline: one stage's list of actions over isend/recv, on real processes;
                   timeline_of (the measured Timeline), pp_traffic_formula (its bytes)
    measure.py     measure_bubble: sleep-timed stages launched on p ranks, measured vs formula

Every name is here: ``from minidist.parallel import pipeline as pp``; ``pp.one_f_one_b(4, 8)``,
``pp.check_schedule(schedule, 8)``, ``pp.draw_ascii(schedule)``, ``pp.run_pipeline(...)``.
"""

from .drawing import draw_ascii, plot_timeline
from .executor import PipelineResult, pp_traffic_formula, run_pipeline, timeline_of
from .measure import SleepStage, measure_bubble
from .schedules import bubble_formula, gpipe, interleaved_one_f_one_b, one_f_one_b, peak_in_flight
from .simulator import ScheduleError, Timeline, check_schedule, simulate

__all__ = [
    "ScheduleError",
    "gpipe",
    "one_f_one_b",
    "interleaved_one_f_one_b",
    "check_schedule",
    "simulate",
    "Timeline",
    "bubble_formula",
    "peak_in_flight",
    "draw_ascii",
    "plot_timeline",
    "run_pipeline",
    "PipelineResult",
    "measure_bubble",
    "timeline_of",
    "SleepStage",
    "pp_traffic_formula",
]
