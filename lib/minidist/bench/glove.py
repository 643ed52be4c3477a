"""``python -m minidist.bench glove``: every GloVe trainer on the same data and epochs.

For each trainer and each worker count it prints pairs per second, the speed-up over
the single process (measured in the same run), the final loss, WordSim353 Spearman
and analogy accuracy, and saves a loss-vs-wall-clock plot with all trainers on one
axis. The goals of issue 5 are checked at the end:

* Hogwild with 2 workers at least 1.7x the single process's pairs per second;
* after 15 epochs on the full corpus, WordSim353 >= 0.35 (Stanford's C GloVe: 0.36);
* more than 1.7M pair updates per second on 2 cores (C GloVe's rate on the same data).

Timings are only meaningful on an otherwise idle machine: the trainers use every core.
"""

from __future__ import annotations

import dataclasses
import time

from ..glove import GloveConfig, evaluate, load
from ..glove import trainers as t
from ._util import new_figure, out_dir, print_table, save_json

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
}


def run(
    corpus: str = "full",
    epochs: int = 15,
    workers: tuple[int, ...] = (1, 2),
    trainers: tuple[str, ...] = tuple(TRAINERS),
    out: str | None = None,
    plot: bool = True,
) -> dict:
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
        rows.append(
            [
                r["trainer"],
                r["workers"],
                r["pairs_per_second"] / 1e6,
                r["pairs_per_second"] / single,
                f"{r['final_loss']:.4f}",
                f"{r['wordsim353']:.3f}",
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
            "loss",
            "WS353",
            "sem %",
            "syn %",
            "MiB sent",
            "train s",
        ],
        rows,
        title=f"GloVe on {corpus!r}, {epochs} epochs, batch {config.batch_size}; "
        "x single = pairs/s over the single process's",
    )
    paired = (
        _paired_speedup(pairs, config)
        if "single" in trainers and "hogwild" in trainers and 2 in workers
        else None
    )
    _check_goals(results, single, corpus, epochs, paired)
    directory = out_dir(out)
    save_json(directory, "glove", results)
    if plot:
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
        ax.set_title(f"GloVe on {corpus!r}: loss vs time, every trainer")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(directory / "glove.png", dpi=120)
        print(f"plot saved to {directory / 'glove.png'}")
    return results


def _paired_speedup(pairs, config: GloveConfig, rounds: int = 3) -> list[float]:
    """Hogwild (2 workers) over single, one epoch each, alternating, ``rounds`` times.

    A shared machine's speed drifts over minutes, so two long runs measured minutes apart
    compare the machine as much as the trainers; alternating short runs pairs them up.
    """
    one_epoch = dataclasses.replace(config, epochs=1)
    ratios = []
    for _ in range(rounds):
        single = t.train_single(pairs, one_epoch).pairs_per_second
        ratios.append(t.train_hogwild(pairs, one_epoch, workers=2).pairs_per_second / single)
    listed = ", ".join(f"{r:.2f}x" for r in ratios)
    print(f"\npaired runs, Hogwild (2 workers) / single, one epoch each: {listed}")
    return ratios


def _check_goals(results: dict, single: float, corpus: str, epochs: int, paired: list[float] | None) -> None:
    lines = []
    if "hogwild/2" in results:
        hogwild = results["hogwild/2"]
        ratio = hogwild["pairs_per_second"] / single
        lines.append(f"Hogwild, 2 workers: {ratio:.2f}x the single process (goal 1.7x): {_met(ratio >= 1.7)}")
        if paired:
            median = sorted(paired)[len(paired) // 2]
            lines.append(f"  ... in paired one-epoch runs: median {median:.2f}x: {_met(median >= 1.7)}")
        rate = hogwild["pairs_per_second"] / 1e6
        lines.append(
            f"Hogwild, 2 workers: {rate:.2f}M pair updates/s (C GloVe on 2 threads: 1.7M): {_met(rate > 1.7)}"
        )
    if corpus == "full" and epochs == 15:
        for key in ("single/1", "hogwild/2"):
            if key in results:
                ws = results[key]["wordsim353"]
                lines.append(f"{key}: WordSim353 {ws:.3f} after 15 epochs (goal 0.35): {_met(ws >= 0.35)}")
    if lines:
        print("\ngoals:\n  " + "\n  ".join(lines))


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"
