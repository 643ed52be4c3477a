"""``python -m minidist.bench ddp``: data-parallel BERT, ours against torch's DDP.

One launch of 2 ranks (shm by default) holds every variant at once, each with its
own copy of the model and optimizer, and runs them **interleaved**: one step of
each variant per round, a barrier between steps. Load that drifts during the run
(a shared 2-core machine) then slows every variant alike, and the ratios printed
are between steps taken seconds apart. Variants, with the same model, data,
global batch and one thread per process (``torch.set_num_threads(1)``):

* torch's ``nn.parallel.DistributedDataParallel`` (default settings) on a gloo
  process group opened in the same processes (a FileStore in a temporary folder);
* our ``DistributedDataParallel`` three ways: ``after backward`` (one flat buffer
  of all gradients, allreduced when backward ends: ``bucket_mb=inf,
  overlap=False``), ``buckets`` (the same buckets as the next row, all after
  backward) and ``overlap`` (each bucket launched as soon as its last gradient is
  ready);
* the same three over an emulated 10 Gbit/s Ethernet link
  (``transport.emulated.ETHERNET_10G`` wrapping the launch's communicator).

A ``one process`` row (the global batch in one process, its own launch, not
interleaved) is printed for context.

The interleaved runs are ``interleaved.py`` (one worker holds every variant); this file
prints their table, checks the goals and draws the timelines. Per row: the median step
time (forward + backward + AdamW step), slowest rank; samples/s; our time over torch DDP's
(< 1: faster); CPU ms per step (all threads of the process: hooks, the communication
thread and its waiting count here, and on a machine with fewer free cores than threads CPU
time is what steps cost); bytes sent per rank per step next to the ring formula
2(p-1)/p x gradient bytes (the shm allreduce moves data through shared memory and sends no
messages: 0 bytes); rank 0's backward span B; C, the time per step during which some
bucket was in flight; and ``trace.overlap``, the share of allreduce time that lay inside
backward.

What overlap can buy at most (the ``bound`` column): ``minidist.parallel.overlap``, with B and
C measured on the ``after backward`` row of the same link (where they do not overlap).

Tokens are synthetic (uniform ids, every 7th position labelled): the speed of a
step does not depend on what the words are. The load average is printed; only
ratios measured in this run are claimed.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict

from ...parallel.overlap import overlap_bound
from .._util import human_bytes, new_figure, out_dir, print_table, save_json
from .interleaved import DdpBench, Mode, _launch, _ours, bench_worker


def run(
    cfg: DdpBench = DdpBench(),  # noqa: B008 (frozen: one shared default is safe)
    transports=("shm",),
    emulated: bool = True,
    out: str | None = None,
    plot: bool = True,
) -> dict:
    """One process (context), then per transport one launch with torch DDP and our
    variants interleaved (the emulated link wraps the first transport)."""
    load_before = os.getloadavg()
    p = cfg.world_size
    rows: list[tuple[str, str, dict]] = []  # (transport, label, result)
    print(f"one process, global batch {cfg.batch * p} ...", flush=True)
    rows.append(("-", "one process", _launch(cfg, [Mode("one process", "single")], 1, "shm")["one process"]))
    torch_rows = {}
    for i, transport in enumerate(transports):
        modes = (
            [Mode("torch DDP", "torch")]
            + _ours(cfg)
            + (_ours(cfg, "emulated") if emulated and i == 0 else [])
        )
        print(f"torch DDP (gloo) and our DDP on {transport}, interleaved ...", flush=True)
        results = _launch(cfg, modes, p, transport)
        torch_rows[transport] = results.pop("torch DDP")
        rows.append(("gloo", "torch DDP", {**torch_rows[transport], "reference_for": transport}))
        for label, r in results.items():
            link = "10G" if label.endswith("(10G)") else transport
            rows.append((link, label, {**r, "torch_step_s": torch_rows[transport]["step_s"]}))
    load_after = os.getloadavg()

    grad_bytes = rows[0][2]["grad_bytes"]
    ring_bytes = 2 * (p - 1) / p * grad_bytes
    samples = cfg.batch * p
    by_label = {(t, label): r for t, label, r in rows}
    table = []
    for transport, label, r in rows:
        sent = r.get("bytes_per_step", math.nan)
        bound = math.nan
        if label.startswith("overlap"):
            after_label = label.replace("overlap", "after backward")
            bound = overlap_bound(by_label[(transport, after_label)], r["tail_share"])[0]
            r["bound"] = bound
        table.append(
            [
                label,
                transport,
                r["step_s"] * 1e3,
                samples / r["step_s"],
                r["step_s"] / r.get("torch_step_s", r["step_s"]) if label != "one process" else math.nan,
                r["cpu_s"] * 1e3,
                human_bytes(int(sent)) if sent == sent else "-",
                human_bytes(int(ring_bytes)) if sent == sent else "-",
                r.get("buckets", "-"),
                r.get("backward_ms", math.nan),
                r.get("comm_ms_per_step", math.nan),
                r.get("overlap", math.nan),
                bound,
            ]
        )
    print()
    print_table(
        [
            "DDP",
            "transport",
            "step ms",
            "samples/s",
            "x torch",
            "cpu ms",
            "bytes/step",
            "ring formula",
            "buckets",
            "B backward ms",
            "C allreduce ms",
            "overlap",
            "bound",
        ],
        table,
        title=f"BERT {cfg.model}, {p} ranks x batch {cfg.batch} x seq {cfg.seq}, 1 thread each, "
        f"gradients {human_bytes(grad_bytes)}, median of {cfg.steps} interleaved steps after {cfg.warmup} "
        "(x torch = our step time / torch DDP's in the same launch; cpu ms: all threads, mean of ranks; "
        "B: rank 0's backward span; C: time per step with some bucket in flight; overlap = share of "
        "allreduce time inside backward; bound = the after-backward row's step / (its step - B - C + "
        "max(B + s*C, C)), s = share of the bytes in buckets that launch only after backward (the word "
        "embedding's and later): the most perfect overlap could gain)",
    )
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} ({os.cpu_count()} cores)")
    goals = _goals(by_label, transports, emulated)
    directory = out_dir(out)
    save_json(
        directory,
        f"ddp_{cfg.model}_p{p}_b{cfg.batch}",
        {
            "config": asdict(cfg),
            "load": [load_before, load_after],
            "rows": [
                {"transport": t, "label": label, **{k: v for k, v in r.items() if k != "events"}}
                for t, label, r in rows
            ],
            "goals": goals,
        },
    )
    if plot:
        path = _plot(rows, directory, cfg)
        print(f"timelines saved to {path}")
    return {"rows": rows, "goals": goals}


def _goals(by_label: dict, transports, emulated: bool) -> dict:
    goals = {}
    if ("shm", "overlap") in by_label:
        over = by_label[("shm", "overlap")]
        goals["shm_overlap_over_torch"] = over["step_s"] / over["torch_step_s"]
        verdict = "met" if goals["shm_overlap_over_torch"] <= 0.9 else "NOT met"
        print(
            f"goal: ours on shm with overlap <= 0.9x torch DDP's step time -> "
            f"{goals['shm_overlap_over_torch']:.2f}x ({verdict})"
        )
    if emulated:
        after, over = by_label[("10G", "after backward (10G)")], by_label[("10G", "overlap (10G)")]
        goals["emulated_speedup"] = after["step_s"] / over["step_s"]
        goals["emulated_bound"], goals["emulated_bound_bc"] = overlap_bound(after, over["tail_share"])
        verdict = "met" if goals["emulated_speedup"] >= 1.3 else "NOT met"
        print(
            f"goal: over 10 Gbit/s, overlap >= 1.3x faster than allreduce after backward -> "
            f"{goals['emulated_speedup']:.2f}x ({verdict}); attainable with perfect overlap: "
            f"{goals['emulated_bound']:.2f}x of the step, (B+C)/max(B,C) = {goals['emulated_bound_bc']:.2f}x"
        )
    return goals


def _plot(rows, directory, cfg: DdpBench):
    """Two timelines, one step each: allreduce after backward vs overlap (emulated link if run)."""
    from ... import trace

    labels = [label for _, label, _ in rows]
    pair = ["after backward (10G)", "overlap (10G)"]
    if not all(label in labels for label in pair):
        pair = ["after backward", "overlap"]
    fig, axes = new_figure(2, figsize=(12, 3.5))
    fig.subplots_adjust(wspace=0.3)
    for ax, label in zip(axes, pair):
        result = next(r for _, lab, r in rows if lab == label)
        events = result["events"]
        last_step = {  # each rank's last forward starts its last step
            rank: max(e["ts_us"] for e in events if e["rank"] == rank and e["name"] == "forward")
            for rank in {e["rank"] for e in events}
        }
        shown = [e for e in events if e["ts_us"] >= last_step[e["rank"]]]
        trace.plot_timeline(shown, ax=ax, title=label)
    path = directory / f"ddp_{cfg.model}_timeline.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


__all__ = ["DdpBench", "Mode", "bench_worker", "overlap_bound", "run"]
