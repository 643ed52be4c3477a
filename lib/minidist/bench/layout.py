"""``python -m minidist.bench layout``: the small layouts of a decoder on 4 ranks, predicted and emulated.

``memory.layout.predict`` ranks layouts by a formula; this runs them. Each layout (DP4, TP2xDP2,
TP4, PP2xDP2, ...) trains a few steps of a course decoder on 4 processes, on the emulated clock:

* compute waits the time ``laptop_cluster`` gives its FLOPs (``clock.TimedLayer``: per block an
  attention part and an MLP part, the embedding on the first stage, the output layer on the
  last, each holding exactly the parameters that rank holds -- ``stage_parameter_count``);
* messages go over ``EmulatedLinkComm`` links (alpha + bytes / bandwidth), one link per group
  (TP, DP, PP), as a cluster gives TP its NVLink and DP its NIC;
* the parallel pieces are the library's: TP's f and g (``parallel.tensor``) around each part,
  DDP (``parallel.ddp``, ring allreduce) for data parallel, ``pipeline.run_pipeline`` with
  1F1B and a ring allreduce of the gradients after the flush for PP.

It prints, per layout, the predicted and the emulated step, their ratio, the ranks of both,
and Spearman's rank correlation; results in bench-results/layout.json.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..clock import TimedLayer
from ..comm import Communicator
from ..memory.cluster import Batch, Cluster, laptop_cluster
from ..memory.layout import Layout, predict
from ..models import decoder
from ..transport.emulated import EmulatedLinkComm
from ._util import out_dir, print_table

__all__ = ["LayoutBench", "parse_layout", "run", "spearman"]

DEFAULT_LAYOUTS = ("DP4", "TP2xDP2", "TP4", "PP2xDP2", "TP2xPP2", "PP4")


@dataclass(frozen=True)
class LayoutBench:
    """A decoder of ``decoder.CONFIGS[model]``, ``sequences`` x ``seq`` tokens a step, on
    ``world_size`` ranks joined by an emulated ``gbit_per_s`` link; ``steps`` timed steps after one.
    The default batches put 256 and 1,024 tokens on each DP4 rank: below and above the 600 of
    ``dp_critical_tokens(laptop_cluster(4), grad_bytes=4, ranks=4)``."""

    model: str = "mini"
    sequences: tuple[int, ...] = (8, 32)
    seq: int = 128
    gbit_per_s: float = 1.0
    steps: int = 2
    layouts: tuple[str, ...] = DEFAULT_LAYOUTS
    world_size: int = 4
    transport: str = "shm"

    def cluster(self) -> Cluster:
        return laptop_cluster(self.world_size, self.gbit_per_s)

    def batches(self) -> list[Batch]:
        return [Batch(n, self.seq) for n in self.sequences]


def parse_layout(name: str) -> Layout:
    """``"TP2xDP2"`` -> Layout(tp=2, dp=2); factors DP, TP, PP joined by x, any order."""
    sizes = {}
    for part in name.split("x"):
        match = re.fullmatch(r"(DP|TP|PP)(\d+)", part.strip().upper())
        if not match:
            raise ValueError(f"layout {name!r}: write factors like DP4, TP2xDP2 or PP2xDP2 (DP, TP, PP)")
        sizes[match[1].lower()] = int(match[2])
    return Layout(**sizes)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties): 1 - 6 sum d^2 / (n (n^2 - 1))."""
    n = len(a)
    rank_a = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: a[i]))}
    rank_b = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: b[i]))}
    d2 = sum((rank_a[i] - rank_b[i]) ** 2 for i in range(n))
    return 1 - 6 * d2 / (n * (n * n - 1)) if n > 1 else 1.0


def _parallel(part: nn.Module, tp_comm: Communicator | None) -> nn.Module:
    """A TP part: f before it (allreduce of the gradient in backward), g after (allreduce forward)."""
    if tp_comm is None:
        return part
    from ..parallel import tensor as tp

    class Split(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.part = part

        def forward(self, x):
            return tp.reduce_from_tensor_parallel(self.part(tp.copy_to_tensor_parallel(x, tp_comm)), tp_comm)

    return Split()


def timed_stage(
    cfg, batch: Batch, layout: Layout, stage: int, tokens: int, rate: float, tp_comm
) -> nn.Sequential:
    """Stage ``stage`` of ``cfg`` as TimedLayers for ``tokens`` tokens a microbatch: per block an
    attention part (6 (4d^2 + 8d) + 12 s d FLOPs a token, split over tp) and an MLP part
    (6 (2df + f + d)), each wrapped in TP's f and g; the first stage's embedding part (and the
    final norm's FLOPs), the last stage's output layer (6 V d). FLOPs add up to
    ``stage_flops_per_token``, parameters to ``stage_parameter_count`` (forward 1/3 of the time,
    backward 2/3)."""
    d, f, t, pp = cfg.hidden_size, cfg.ffn_size, layout.tp, layout.pp

    def timed(numel: int, flops_per_token: float) -> TimedLayer:
        seconds = flops_per_token * tokens / t / rate
        return TimedLayer(max(1, numel), seconds / 3, 2 * seconds / 3)

    parts = []
    rest = cfg.type_vocab_size * d + (cfg.max_positions * d if cfg.position == "learned" else 0)
    rest += 2 * d if cfg.embedding_layernorm else 0
    final = 2 * d if cfg.pre_ln else 0
    if stage == 0:  # the final norm's FLOPs counted here, as stage_flops_per_token does
        parts.append(timed(cfg.vocab_size * d // t + rest, 6 * (rest + final)))
    for _ in range(cfg.n_layers // pp):
        attention = (3 * d * d + 3 * d) // t + d * d // t + d + 2 * d
        mlp = (d * f + f) // t + f * d // t + d + 2 * d
        parts.append(_parallel(timed(attention, 6 * (4 * d * d + 8 * d) + 12 * batch.seq * d), tp_comm))
        parts.append(_parallel(timed(mlp, 6 * (2 * d * f + f + d)), tp_comm))
    if stage == pp - 1:
        word = cfg.vocab_size * d // t if pp > 1 else 0  # the tied table's copy on the last stage
        parts.append(timed(final + word, 6 * cfg.vocab_size * d))
    return nn.Sequential(*parts)


def _groups(rank: int, layout: Layout) -> tuple[list[int], list[int], list[int], int]:
    """TP innermost, then DP, PP outermost: this rank's TP, DP and PP groups and its stage."""
    tp, dp = layout.tp, layout.dp
    t_i, d_i, stage = rank % tp, rank // tp % dp, rank // (tp * dp)
    tp_group = [stage * tp * dp + d_i * tp + i for i in range(tp)]
    dp_group = [stage * tp * dp + j * tp + t_i for j in range(dp)]
    pp_group = [s * tp * dp + d_i * tp + t_i for s in range(layout.pp)]
    return tp_group, dp_group, pp_group, stage


def _layout_worker(comm: Communicator, bench: LayoutBench) -> dict:
    import minidist as md

    from ..parallel import pipeline as pp
    from ..parallel.buckets import allreduce_average
    from ..parallel.ddp import DistributedDataParallel
    from ..parallel.group import SubComm

    torch.set_num_threads(1)
    cfg, cluster = decoder.CONFIGS[bench.model], bench.cluster()
    out = {}
    for batch, name in itertools.product(bench.batches(), bench.layouts):
        layout = parse_layout(name)
        tp_group, dp_group, pp_group, stage = _groups(comm.rank, layout)
        wires = []

        def group(ranks: list[int]):
            if len(ranks) == 1:
                return None
            wire = EmulatedLinkComm(comm, *cluster.link(max(ranks) - min(ranks) + 1))  # its own link
            wires.append(wire)
            return SubComm(wire, ranks)

        tp_comm, dp_comm, pp_comm = group(tp_group), group(dp_group), group(pp_group)
        micro = 1 if layout.pp > 1 else batch.sequences // layout.dp
        m = batch.sequences // layout.dp // micro
        model = timed_stage(cfg, batch, layout, stage, micro * batch.seq, cluster.flops_per_s, tp_comm)
        x = torch.zeros(m * micro, batch.seq, cfg.hidden_size)
        if layout.pp == 1 and dp_comm is not None:  # DDP's first broadcast off the link; buckets on it
            ring = functools.partial(allreduce_average, dp_comm, algorithm="ring")
            net = DistributedDataParallel(
                model, SubComm(comm, dp_group), comm_hook=lambda _c, g, i: ring(g, i)
            )
        else:
            net = model
        schedule = pp.one_f_one_b(layout.pp, m)[stage] if pp_comm is not None else None
        seconds, sent = [], []
        for _ in range(bench.steps + 1):
            md.barrier(comm)
            before, start = comm.stats.bytes_sent, time.perf_counter()
            if schedule is None:
                net(x).mean().backward()  # DDP: buckets allreduced as backward fills them
            else:
                pp.run_pipeline(
                    model, pp_comm, schedule, inputs=x if stage == 0 else None,
                    targets=x if stage == layout.pp - 1 else None, loss_fn=lambda y, _: y.mean(),
                )  # fmt: skip
                if dp_comm is not None:  # after the flush, hidden behind nothing
                    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                    md.allreduce(dp_comm, flat, op="avg", algorithm="ring")
            seconds.append(time.perf_counter() - start)
            sent.append(comm.stats.bytes_sent - before)
            model.zero_grad(set_to_none=False)
        for wire in wires:
            wire.close()
        out[(batch.sequences, name)] = {"seconds": seconds[1:], "bytes_sent": sent[-1]}
    return out


def run(bench: LayoutBench, out: str | None = None) -> dict:
    """Predict, launch (one launch for every batch and layout), print a table a batch; returns
    (and writes) the results."""
    import minidist as md

    cfg, cluster = decoder.CONFIGS[bench.model], bench.cluster()
    ranks = md.launch(_layout_worker, bench.world_size, args=(bench,), transport=bench.transport, timeout=300)
    result = {"bench": asdict(bench), "cluster": cluster.name, "batches": {}}
    for batch in bench.batches():
        rows = {}
        for name in bench.layouts:
            plan = predict(cfg, cluster, batch, parse_layout(name), precision="fp32")
            per_rank = [r[(batch.sequences, name)] for r in ranks]
            steps = [max(r["seconds"][i] for r in per_rank) for i in range(bench.steps)]  # slowest rank
            rows[name] = {"predicted_s": plan.step_s, "emulated_s": sorted(steps)[len(steps) // 2],
                          "steps_s": steps, "parts": plan.parts,
                          "bytes_sent": [r["bytes_sent"] for r in per_rank]}  # fmt: skip
        predicted = [row["predicted_s"] for row in rows.values()]
        emulated = [row["emulated_s"] for row in rows.values()]
        table = []
        for name, row in rows.items():
            row["ratio"] = row["predicted_s"] / row["emulated_s"]
            row["rank_predicted"] = 1 + sorted(predicted).index(row["predicted_s"])
            row["rank_emulated"] = 1 + sorted(emulated).index(row["emulated_s"])
            table.append([name, row["predicted_s"] * 1e3, row["emulated_s"] * 1e3, row["ratio"],
                          row["rank_predicted"], row["rank_emulated"]])  # fmt: skip
        title = (
            f"\n{bench.model}, {batch.sequences} x {batch.seq} = {batch.tokens} tokens a step, {cluster.name}"
        )
        print_table(
            ["layout", "predicted ms", "emulated ms", "pred/emul", "rank pred", "rank emul"], table, title
        )
        rho = spearman(predicted, emulated)
        print(f"Spearman's rank correlation, predicted vs emulated: {rho:.2f}", flush=True)
        result["batches"][str(batch.sequences)] = {"rows": rows, "spearman": rho}
    (out_dir(out) / "layout.json").write_text(json.dumps(result, indent=2))
    return result


def add_parser(sub) -> None:
    parser = sub.add_parser("layout", help="predicted vs emulated step of DP/TP/PP layouts on 4 ranks")
    d = LayoutBench()
    parser.add_argument("--model", default=d.model, help=f"decoder config (default {d.model})")
    parser.add_argument("--sequences", type=int, nargs="+", default=list(d.sequences), help="global batches")
    parser.add_argument("--seq", type=int, default=d.seq, help="tokens a sequence")
    parser.add_argument("--gbit", type=float, default=d.gbit_per_s, help="emulated link, Gbit/s")
    parser.add_argument("--steps", type=int, default=d.steps, help="timed steps after one warm-up")
    parser.add_argument("--layouts", nargs="+", default=list(d.layouts), help="e.g. DP4 TP2xDP2 PP2xDP2")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench-results/)")


def main(args) -> None:
    bench = LayoutBench(model=args.model, sequences=tuple(args.sequences), seq=args.seq, gbit_per_s=args.gbit,
                        steps=args.steps, layouts=tuple(args.layouts))  # fmt: skip
    run(bench, args.out)
