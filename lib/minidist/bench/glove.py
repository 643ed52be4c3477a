"""``python -m minidist.bench glove``: every GloVe trainer on the same data and epochs.

For each trainer and each worker count it prints pairs per second, the speed-up over
the single process and over the baseline with as many threads (both measured in the
same run), the loss of the final model (one formula for every trainer), WordSim353 and
SimLex-999 Spearman and analogy accuracy, and saves a loss-vs-wall-clock plot with all
trainers on one axis.

The baseline is an established, installed GloVe trainer, glove-python's Cython code
(``glove_baseline``), trained on exactly our pairs for as many epochs with 1 and 2
threads. Only ratios measured in one run are claimed: a number from another run, day or
machine compares the moments as much as the trainers. A shared machine also drifts
within a run, so the speed ratios that matter are measured once more in *paired*
one-epoch runs, each trainer in turn, three rounds (the median is reported).

The goals (issues 5 and 9) are checked at the end:

* Hogwild with 2 workers at least 1.7x the single process's pairs per second;
* Hogwild with 2 workers at least 1.5x glove-python on 2 threads;
* after 15 epochs on the full corpus, WordSim353 >= 0.35, and how it compares with the
  baseline's in this run.

Timings are only meaningful on an otherwise idle machine: the trainers use every core.
"""

from __future__ import annotations

import dataclasses
import time

from ..glove import GloveConfig, Pairs, evaluate, full_loss, load
from ..glove import trainers as t
from ._util import new_figure, out_dir, print_table, save_json
from .glove_baseline import BASELINE_NAME, train_glove_python

TRAINERS = {
    "single": lambda pairs, config, workers: t.train_single(pairs, config),
    "data-sparse": lambda pairs, config, workers: t.train_data_parallel(
        pairs, config, workers=workers, variant="sparse"
    ),
    "data-dense": lambda pairs, config, workers: t.train_data_parallel(
        pairs, config, workers=workers, variant="dense"
    ),
    "model": lambda pairs, config, workers: t.train_model_parallel(pairs, config, workers=workers),
    "ps-sync": lambda pairs, config, workers: t.train_param_server(
        pairs, config, workers=workers, mode="sync"
    ),
    "ps-async": lambda pairs, config, workers: t.train_param_server(
        pairs, config, workers=workers, mode="async"
    ),
    "ps-async-stale": lambda pairs, config, workers: t.train_param_server(
        pairs, config, workers=workers, mode="async", staleness_aware=True
    ),
    "hogwild": lambda pairs, config, workers: t.train_hogwild(pairs, config, workers=workers),
    # the baseline: workers = its threads (module glove_baseline)
    BASELINE_NAME: lambda pairs, config, workers: train_glove_python(pairs, config, threads=workers),
}


def run(
    corpus: str = "full",
    epochs: int = 15,
    workers: tuple[int, ...] = (1, 2),
    trainers: tuple[str, ...] = tuple(TRAINERS),
    out: str | None = None,
    plot: bool = True,
) -> dict:
    """Train every trainer in ``trainers`` with each worker count; print, save and plot.

    Returns ``{"trainer/workers": measurements}``; ``"paired"`` holds the paired
    one-epoch speed ratios when their trainers were run.
    """
    unknown = set(trainers) - set(TRAINERS)
    if unknown:
        raise SystemExit(f"unknown trainers {sorted(unknown)}; choose from {list(TRAINERS)}")
    data = load(corpus)
    config = GloveConfig(epochs=epochs)
    print(f"{data}; {config}", flush=True)
    pairs = data.pairs
    results, rows = {}, []
    for name in trainers:
        for count in (1,) if name == "single" else workers:
            print(f"training {name} with {count} worker(s) ...", flush=True)
            started = time.perf_counter()
            result = TRAINERS[name](pairs, config, count)
            wall = time.perf_counter() - started
            quality = evaluate(result.vectors(), data.vocab)
            results[f"{name}/{count}"] = {
                "trainer": name,
                "workers": count,
                "pairs_per_second": result.pairs_per_second,
                "train_seconds": result.seconds,
                "wall_seconds": wall,
                "final_loss": result.final_loss,
                # every trainer's final parameters, one formula: comparable across trainers
                "end_loss": full_loss(result.table, pairs),
                "history": result.history,
                "comm_bytes": result.comm_bytes,
                "wordsim353": quality.wordsim353,
                "simlex999": quality.simlex999,
                "analogy_semantic": quality.analogy.semantic,
                "analogy_syntactic": quality.analogy.syntactic,
            }
            print(f"  {result}; {quality}", flush=True)
    single = results["single/1"]["pairs_per_second"] if "single/1" in results else float("nan")
    for r in results.values():
        baseline = results.get(f"{BASELINE_NAME}/{r['workers']}", {}).get("pairs_per_second", float("nan"))
        rows.append(
            [
                r["trainer"],
                r["workers"],
                r["pairs_per_second"] / 1e6,
                r["pairs_per_second"] / single,
                r["pairs_per_second"] / baseline,
                f"{r['end_loss']:.4f}",
                f"{r['wordsim353']:.3f}",
                f"{r['simlex999']:.3f}",
                100 * r["analogy_semantic"],
                100 * r["analogy_syntactic"],
                r["comm_bytes"] / 2**20,
                r["train_seconds"],
            ]
        )
    print()
    print_table(
        [
            "trainer",
            "workers",
            "M pairs/s",
            "x single",
            "x base",
            "end loss",
            "WS353",
            "SL999",
            "sem %",
            "syn %",
            "MiB sent",
            "train s",
        ],
        rows,
        title=f"GloVe on {corpus!r}, {epochs} epochs, batch {config.batch_size}; "
        f"x single = pairs/s over the single process's, x base = over {BASELINE_NAME}'s "
        "with as many threads as workers (same run); end loss = mean f diff^2/2 of the final model",
    )
    paired = _paired_speedups(pairs, config, [k for k in PAIRED_RUNS if k in results])
    if paired:
        results["paired"] = paired
    _check_goals(results, single, corpus, epochs, paired)
    directory = out_dir(out)
    save_json(directory, "glove", results)
    if plot:
        _plot({k: v for k, v in results.items() if k != "paired"}, corpus, directory)
    return results


def _plot(results: dict, corpus: str, directory) -> None:
    from matplotlib.ticker import NullFormatter

    fig, ax = new_figure(1, figsize=(8, 5))
    names = list(dict.fromkeys(r["trainer"] for r in results.values()))
    for key, r in results.items():  # a colour per trainer; dashed: 1 worker, solid: more
        seconds, losses = zip(*r["history"], strict=True)
        colour = "black" if r["trainer"] == "single" else f"C{names.index(r['trainer']) % 10}"
        style = "--" if r["workers"] == 1 and r["trainer"] != "single" else "-"
        ax.plot(seconds, losses, style, marker="o", markersize=3, color=colour, label=key)
    ax.set(
        xlabel="wall-clock seconds of training",
        ylabel="mean loss of the epoch",
        xscale="log",
        yscale="log",
    )
    ax.xaxis.set_minor_formatter(NullFormatter())  # the minor labels of a log axis overlap
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_title(f"GloVe on {corpus!r}: loss vs time, every trainer ({BASELINE_NAME}: loss after each epoch)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(directory / "glove.png", dpi=120)
    print(f"plot saved to {directory / 'glove.png'}")


# The runs paired one epoch at a time, and the ratios taken from them (numerator, denominator).
PAIRED_RUNS = ("single/1", f"{BASELINE_NAME}/1", "hogwild/2", f"{BASELINE_NAME}/2")
PAIRED_RATIOS = (
    ("hogwild/2", "single/1"),
    ("hogwild/2", f"{BASELINE_NAME}/2"),
    ("single/1", f"{BASELINE_NAME}/1"),
)


def _paired_speedups(
    pairs: Pairs, config: GloveConfig, keys: list[str], rounds: int = 3
) -> dict[str, list[float]]:
    """Speed ratios from one-epoch runs of ``keys`` in turn, ``rounds`` times.

    A shared machine's speed drifts over minutes, so two long runs measured minutes apart
    compare the machine as much as the trainers; runs of one epoch each, one right after
    the other, pair them up. Returns ``{"a / b": [ratio of round 1, ...]}``.
    """
    wanted = [(a, b) for a, b in PAIRED_RATIOS if a in keys and b in keys]
    if not wanted:
        return {}
    one_epoch = dataclasses.replace(config, epochs=1)
    speeds: dict[str, list[float]] = {key: [] for key in keys}
    for _ in range(rounds):
        for key in keys:
            name, count = key.split("/")
            speeds[key].append(TRAINERS[name](pairs, one_epoch, int(count)).pairs_per_second)
    ratios = {f"{a} / {b}": [x / y for x, y in zip(speeds[a], speeds[b])] for a, b in wanted}
    print(f"\npaired runs, one epoch each, in turn ({', '.join(keys)}), {rounds} rounds:")
    for label, values in ratios.items():
        listed = ", ".join(f"{r:.2f}x" for r in values)
        print(f"  {label}: {listed} (median {median(values):.2f}x)")
    return ratios


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _check_goals(
    results: dict, single: float, corpus: str, epochs: int, paired: dict[str, list[float]]
) -> None:
    lines = []
    baseline2 = f"{BASELINE_NAME}/2"
    if "hogwild/2" in results:
        hogwild = results["hogwild/2"]
        ratio = hogwild["pairs_per_second"] / single
        lines.append(f"Hogwild, 2 workers: {ratio:.2f}x the single process (goal 1.7x): {_met(ratio >= 1.7)}")
        if "hogwild/2 / single/1" in paired:
            m = median(paired["hogwild/2 / single/1"])
            lines.append(f"  ... in paired one-epoch runs: median {m:.2f}x: {_met(m >= 1.7)}")
        if baseline2 in results:
            ratio = hogwild["pairs_per_second"] / results[baseline2]["pairs_per_second"]
            lines.append(
                f"Hogwild, 2 workers: {ratio:.2f}x {BASELINE_NAME} on 2 threads (goal 1.5x): "
                f"{_met(ratio >= 1.5)}"
            )
        if f"hogwild/2 / {baseline2}" in paired:
            m = median(paired[f"hogwild/2 / {baseline2}"])
            lines.append(f"  ... in paired one-epoch runs: median {m:.2f}x: {_met(m >= 1.5)}")
    if corpus == "full" and epochs == 15:
        for key in ("single/1", "hogwild/2"):
            if key in results:
                ws = results[key]["wordsim353"]
                lines.append(f"{key}: WordSim353 {ws:.3f} after 15 epochs (goal 0.35): {_met(ws >= 0.35)}")
    for key in (f"{BASELINE_NAME}/1", baseline2):
        if key in results:
            row = results[key]
            lines.append(
                f"{key}: WordSim353 {row['wordsim353']:.3f}, end loss {row['end_loss']:.4f} "
                f"(the same {epochs} epochs on the same pairs)"
            )
    if lines:
        print("\ngoals:\n  " + "\n  ".join(lines))


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"
