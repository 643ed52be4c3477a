"""Traces: what each rank was doing, and when -- spans, messages, a timeline.

A ``Recorder`` belongs to one rank. It stores *events*, plain dicts that pickle,
so a worker can return them from ``md.launch`` and the notebook can put the
ranks side by side::

    def worker(comm):
        rec = trace.Recorder(rank=comm.rank)
        trace.attach(comm, rec)                       # every send/recv becomes a "message" event
        with rec.span("forward"): ...
        with rec.span("backward"):
            token = rec.begin("allreduce", cat="comm")  # an async span: may end on another thread
            ...
        rec.end(token)
        return rec.events

    events = sum(md.launch(worker, 2), [])
    trace.export_chrome("trace.json", events)         # open in https://ui.perfetto.dev
    trace.plot_timeline(events)                       # or look at it in the notebook
    trace.overlap(events)                             # how much communication hid under backward

An event is ``{"name", "cat", "rank", "tid", "ts_us", "dur_us", "args"}``:
``cat`` is "compute", "comm", "message" or "optimizer"; ``ts_us`` is the start in
microseconds of ``time.perf_counter_ns`` -- on Linux a system-wide monotonic clock,
so the events of ranks on one machine line up without any clock synchronisation
(``Recorder.t0`` is kept for printing times relative to the recorder's start);
``tid`` numbers the threads of one recorder in the order they first recorded (0 is
the thread that made the recorder) and ``args["thread"]`` is the thread's name.

The package, one idea per module: ``recorder`` (the ``Recorder`` and its events),
``messages`` (``attach``/``detach``: a communicator's send/recv become message events),
``chrome`` (``export_chrome``: the events as a Chrome/Perfetto trace) and ``timeline``
(``plot_timeline`` to look at them, ``overlap`` to measure how much communication hid).

A foundation: it imports nothing from minidist but the ``Communicator`` type of
``minidist.comm``, so every layer may record into it.
"""

from .chrome import chrome_trace, export_chrome
from .messages import attach, detach
from .recorder import CATEGORIES, Recorder
from .timeline import COLOURS, overlap, plot_timeline

__all__ = [
    "CATEGORIES",
    "COLOURS",
    "Recorder",
    "attach",
    "chrome_trace",
    "detach",
    "export_chrome",
    "overlap",
    "plot_timeline",
]
