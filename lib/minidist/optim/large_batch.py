"""The large-batch experiment: the same model and samples with global batches B, 4B, 16B, 64B.

More workers mean a larger global batch: with 64 ranks of B samples each, every step averages
64B gradients. For the same number of samples that is 64x fewer steps -- how far can the
learning rate make up for it? Three recipes, each run at every batch size:

    "adam-linear"  Adam, lr = base · k             (Goyal et al.'s rule, made for SGD)
    "adam-sqrt"    Adam, lr = base · sqrt(k)       (the rule that matches Adam's normalisation)
    "lamb"         LAMB, lr = base · sqrt(k)       (per-layer trust ratio, You et al. 2019)

each with gradual warm-up from the base rate over the first ``warmup_fraction`` of the samples
(a fixed number of samples, as Goyal's 5 epochs, so fewer steps for larger batches) and a
linear decay to 0 at the end. Weight decay and the trust ratio skip biases and LayerNorm
(``param_groups``); Adam is ``torch.optim.AdamW`` on the same groups.

A large batch is computed by *gradient accumulation* in one process: the batch is cut into
micro-batches of at most ``micro_batch`` samples, and each micro-batch's mean loss is
weighted by its share of the batch before ``backward`` adds it to ``.grad``:

    ∇ (1/N) Σ_n loss_n  =  Σ_i (N_i/N) · ∇ (1/N_i) Σ_{n in micro-batch i} loss_n

-- the same sum data parallelism computes when rank i holds micro-batch i and the allreduce
averages (``accumulate_gradients``; the test compares it with the one-batch gradient).

The model (measured, see docs/library.md, "The BERT track"): BERT ``tiny`` runs about 0.1 s per step of 8 x 32
tokens on one thread of the course machine, so a sweep of 12 runs over the same ~60k
samples would take an hour. The experiment therefore trains a small classifier instead, a
teacher-student problem that keeps what the optimisers care about (matrices, biases,
LayerNorm, a cross-entropy loss) and runs the whole sweep in well under a minute:

    x ~ N(0, I_32) ── teacher: fixed random linear map 32 -> 10 ── y = argmax (labels)
    student: Linear 32-128 ─ LayerNorm ─ GELU ─ Linear 128-128 ─ LayerNorm ─ GELU ─ Linear 128-10
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from minidist.optim.groups import param_groups
from minidist.optim.lamb import LAMB
from minidist.optim.schedules import scaled_lr, warmup_decay_schedule

__all__ = [
    "METHODS",
    "LargeBatchConfig",
    "Problem",
    "RunResult",
    "accumulate_gradients",
    "make_model",
    "make_problem",
    "plot",
    "run_experiment",
    "summary_rows",
    "train_run",
]

METHODS = ("adam-linear", "adam-sqrt", "lamb")


@dataclass(frozen=True)
class LargeBatchConfig:
    """One sweep: every method in ``methods`` at every batch ``base_batch · k``, k in ``multipliers``."""

    base_batch: int = 32
    multipliers: tuple[int, ...] = (1, 4, 16, 64)
    methods: tuple[str, ...] = METHODS
    samples: int = 65536  # per run, the same for every batch size
    micro_batch: int = 512  # largest forward pass; larger batches accumulate
    adam_lr: float = 4e-3  # at base_batch (about the best at B=32: 1e-3..8e-3 tried)
    lamb_lr: float = 2e-2  # at base_batch (about the best at B=32: 5e-3..2e-2 tried)
    weight_decay: float = 0.01
    warmup_fraction: float = 0.05  # of the samples
    eval_points: int = 16  # evaluations per run (plus one before training)
    input_dim: int = 32
    hidden: int = 128
    classes: int = 10
    train_size: int = 65536  # = samples: every run sees each sample once
    eval_size: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}: use some of {METHODS}")
        largest = self.base_batch * max(self.multipliers)
        if (
            self.samples % largest
            or self.samples % self.eval_points
            or (self.samples // self.eval_points) % largest
        ):
            raise ValueError(
                f"samples ({self.samples}) must be a multiple of eval_points x the largest batch "
                f"({self.eval_points} x {largest}) so every run is evaluated at the same sample counts"
            )


@dataclass(frozen=True)
class Problem:
    train_x: torch.Tensor
    train_y: torch.Tensor
    eval_x: torch.Tensor
    eval_y: torch.Tensor


@dataclass
class RunResult:
    """One run: ``samples``/``eval_loss``/``eval_accuracy`` at each evaluation, ``train_loss`` per step."""

    method: str
    batch: int
    lr: float
    steps: int
    samples: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    eval_accuracy: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def eval_steps(self) -> list[int]:
        """Optimizer steps at each evaluation (``samples // batch``): for loss vs steps."""
        return [s // self.batch for s in self.samples]

    @property
    def final_loss(self) -> float:
        return self.eval_loss[-1]


def make_problem(cfg: LargeBatchConfig) -> Problem:
    """Gaussian inputs labelled by a fixed random linear teacher (seeded): a train and a held-out set.

    The classes are linearly separable, so the loss can keep falling as long as training goes
    on: what a run reaches is limited by its optimisation (steps, learning rate), not by noise
    in the labels -- which is what the experiment is about.
    """
    gen = torch.Generator().manual_seed(cfg.seed + 1000)
    teacher = torch.randn(cfg.input_dim, cfg.classes, generator=gen)
    x = torch.randn(cfg.train_size + cfg.eval_size, cfg.input_dim, generator=gen)
    y = (x @ teacher).argmax(-1)
    n = cfg.train_size
    return Problem(x[:n], y[:n], x[n:], y[n:])


def make_model(cfg: LargeBatchConfig) -> nn.Module:
    """The student MLP, initialised from ``cfg.seed`` (the same weights for every run)."""
    torch.manual_seed(cfg.seed)
    d = cfg.hidden
    return nn.Sequential(
        nn.Linear(cfg.input_dim, d),
        nn.LayerNorm(d),
        nn.GELU(),
        nn.Linear(d, d),
        nn.LayerNorm(d),
        nn.GELU(),
        nn.Linear(d, cfg.classes),
    )


def accumulate_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batch: int) -> float:
    """Add to ``.grad`` the gradient of the batch's mean cross-entropy, micro-batch by micro-batch.

    Returns the batch's mean loss. Equal (up to rounding) to one backward of the whole batch.
    """
    total = len(x)
    loss_sum = 0.0
    for start in range(0, total, micro_batch):
        xs, ys = x[start : start + micro_batch], y[start : start + micro_batch]
        loss = nn.functional.cross_entropy(model(xs), ys)
        (loss * (len(xs) / total)).backward()  # weight by the micro-batch's share of the batch
        loss_sum += loss.item() * len(xs)
    return loss_sum / total


@torch.no_grad()
def _evaluate(model: nn.Module, problem: Problem) -> tuple[float, float]:
    logits = model(problem.eval_x)
    loss = nn.functional.cross_entropy(logits, problem.eval_y).item()
    return loss, (logits.argmax(-1) == problem.eval_y).float().mean().item()


def _sample_order(cfg: LargeBatchConfig) -> torch.Tensor:
    """The stream of training indices, one permutation per epoch: the same for every batch size."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    epochs = -(-cfg.samples // cfg.train_size)
    return torch.cat([torch.randperm(cfg.train_size, generator=gen) for _ in range(epochs)])[: cfg.samples]


def train_run(cfg: LargeBatchConfig, method: str, batch: int, problem: Problem | None = None) -> RunResult:
    """Train ``make_model(cfg)`` on ``cfg.samples`` samples with global batch ``batch`` and ``method``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: use one of {METHODS}")
    problem = problem or make_problem(cfg)
    model = make_model(cfg)
    rule = "linear" if method == "adam-linear" else "sqrt"
    base_lr = cfg.lamb_lr if method == "lamb" else cfg.adam_lr
    lr = scaled_lr(base_lr, batch, cfg.base_batch, rule)
    groups = param_groups(model, cfg.weight_decay)
    if method == "lamb":
        optimizer: torch.optim.Optimizer = LAMB(groups, lr=lr)
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr, foreach=True)
    steps = cfg.samples // batch
    warmup = math.ceil(cfg.warmup_fraction * cfg.samples / batch)
    schedule = warmup_decay_schedule(optimizer, warmup, steps, "linear", start_factor=base_lr / lr)
    order = _sample_order(cfg)
    result = RunResult(method, batch, lr, steps)
    eval_every = cfg.samples // cfg.eval_points // batch  # steps between evaluations
    loss, accuracy = _evaluate(model, problem)
    result.samples.append(0)
    result.eval_loss.append(loss)
    result.eval_accuracy.append(accuracy)
    start = time.perf_counter()
    for step in range(steps):
        indices = order[step * batch : (step + 1) * batch]
        optimizer.zero_grad(set_to_none=True)
        result.train_loss.append(
            accumulate_gradients(model, problem.train_x[indices], problem.train_y[indices], cfg.micro_batch)
        )
        optimizer.step()
        schedule.step()
        if (step + 1) % eval_every == 0:
            loss, accuracy = _evaluate(model, problem)
            result.samples.append((step + 1) * batch)
            result.eval_loss.append(loss if math.isfinite(loss) else math.nan)
            result.eval_accuracy.append(accuracy)
    result.seconds = time.perf_counter() - start
    return result


def run_experiment(cfg: LargeBatchConfig = LargeBatchConfig(), threads: int | None = 1) -> list[RunResult]:
    """Every method at every batch size, on ``threads`` torch threads (restored after; None: as is)."""
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        problem = make_problem(cfg)
        results: list[RunResult] = []
        for method in cfg.methods:
            for k in cfg.multipliers:
                twin = next((r for r in results if r.batch == cfg.base_batch and r.method != "lamb"), None)
                if k == 1 and method != "lamb" and twin is not None:
                    # at k = 1 both Adam rules give the base rate: the same run, not trained twice
                    results.append(dataclasses.replace(twin, method=method))
                    continue
                results.append(train_run(cfg, method, cfg.base_batch * k, problem))
        return results
    finally:
        torch.set_num_threads(previous)


def summary_rows(results: list[RunResult]) -> list[list]:
    """Rows ``[method, batch, lr, steps, final eval loss, final eval accuracy, seconds]``."""
    return [[r.method, r.batch, r.lr, r.steps, r.final_loss, r.eval_accuracy[-1], r.seconds] for r in results]


def plot(results: list[RunResult], axes=None):
    """Held-out loss (log scale) vs samples (left) and vs steps (right, log), one colour per batch size.

    Line style per method: solid adam-linear, dashed adam-sqrt, dotted lamb. Returns the figure.
    """
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    fig = axes[0].figure
    batches = sorted({r.batch for r in results})
    colours = {b: plt.cm.viridis(i / max(1, len(batches) - 1)) for i, b in enumerate(batches)}
    styles = {"adam-linear": "-", "adam-sqrt": "--", "lamb": ":"}
    for r in results:
        steps = r.eval_steps
        label = f"{r.method} B={r.batch}"
        axes[0].plot(r.samples, r.eval_loss, styles[r.method], color=colours[r.batch], label=label)
        axes[1].plot(steps, r.eval_loss, styles[r.method], color=colours[r.batch], label=label)
    axes[0].set_xlabel("samples seen")
    axes[1].set_xlabel("optimizer steps")
    axes[1].set_xscale("symlog", linthresh=1)
    for ax in axes:
        ax.set_ylabel("held-out loss")
        ax.set_yscale("log")  # a diverging run spikes to ~10 while the others end near 0.1
    axes[1].legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return fig
