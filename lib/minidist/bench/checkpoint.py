"""Checkpoints: ours (``minidist.checkpoint``, safetensors) beside torch.distributed.checkpoint (DCP).

    python -m minidist.bench checkpoint [--world-size 2] [--hidden 256] [--layers 4] [--repeats 3]

In one launch on the torch transport (its gloo group is DCP's), every rank holds the same
decoder (its state dict replicated) and each side saves it, then loads it into a fresh model:

    save / load      seconds (median of the repeats, min-max beside it), bytes on disk,
                     ratio = DCP's time / ours (> 1: ours is faster); both write one copy
                     of a replicated tensor (ours: the lowest rank that holds it; DCP's planner
                     deduplicates the same way)

Then the asynchronous save: ``steps`` training steps that include one checkpoint, three ways,
each timed from the first step to the end of the last (and of the save), ranks in lockstep.
A step is ``step_ms`` of emulated compute (``minidist.clock.wait``: what a GPU would spend,
no CPU and no GIL taken, as on a GPU the host is free while kernels run) followed by a real
in-place update of every parameter (what the snapshot must not see):

    no save      the steps alone
    sync save    save() (the whole write blocks), then the steps
    async save   save(..., async_save=True) (blocks for the snapshot copy only), the steps while
                 the background thread writes, then handle.wait() (a barrier; metadata.json)
    ratio        each time / "no save": the step-time cost of taking the checkpoint

Then sharded state, once: ours saves the library's ZeRO-3 (``zero.FullyShardedModule``), DCP
saves torch's FSDP2 (``fully_shard``: each parameter a DTensor of this rank's rows), and each
loads its checkpoint into the full, unsharded model (what world size 1 holds: a load sends
nothing, so any rank can stand for it).

The saves and loads are wall-clock (disk and CPU): the machine's load moves them (the tables
give min-max over the repeats; docs/benchmarks.md states the run); bytes are exact. Both
sides fsync their files (DCP's FileSystemWriter does by default). What each side loads is
checked equal to what the other loaded and to the saved tensors (torch.equal), replicated and
sharded alike.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from .. import clock
from ..comm import Communicator
from ._util import human_bytes, out_dir, print_table, save_json


@dataclass(frozen=True)
class CheckpointBench:
    world_size: int = 2
    hidden: int = 256
    layers: int = 4
    vocab: int = 4096
    repeats: int = 3
    steps: int = 5
    step_ms: float = 20.0


def _model(cfg: CheckpointBench, seed: int):
    from ..models.decoder import DecoderLM
    from ..models.transformer import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(vocab_size=cfg.vocab, hidden_size=cfg.hidden, n_layers=cfg.layers,
                               n_heads=4, max_positions=64, causal=True, pre_ln=True)  # fmt: skip
    return DecoderLM(config)


def _disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _timed(comm: Communicator, fn) -> float:
    comm.barrier()
    start = time.perf_counter()
    fn()
    comm.barrier()  # a save is done when every rank is done
    return time.perf_counter() - start


def _steps(model, count: int, step_s: float) -> None:
    """``count`` steps: ``step_s`` of emulated compute, then every parameter updated in place."""
    for _ in range(count):
        clock.wait(step_s)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)


def _check_equal(state: dict, by_ours: dict, by_dcp: dict) -> None:
    """Each side's loaded tensors against the other's, and both against the saved ones."""
    for k in state:
        if not torch.equal(by_ours[k], by_dcp[k]):
            raise AssertionError(f"{k}: what ours loaded differs from what DCP loaded")
        if not torch.equal(by_ours[k], state[k]):
            raise AssertionError(f"{k}: the loaded tensor differs from the saved one")


def _sharded(comm: Communicator, cfg: CheckpointBench, root: str, state: dict) -> dict:
    """Sharded state, saved at this world size and loaded into the full model (what world size 1
    holds; a load sends nothing, so it is the same on any rank): ours from the library's ZeRO-3
    (``FullyShardedModule``), DCP from torch's FSDP2 (``fully_shard``: DTensor shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from .. import checkpoint
    from ..parallel.zero import FullyShardedModule

    ours, theirs = os.path.join(root, "ours-sharded"), os.path.join(root, "dcp-sharded")
    zero3 = FullyShardedModule(_model(cfg, seed=0), comm)
    out = {"ours sharded save": _timed(comm, lambda: checkpoint.save(ours, zero3, comm))}
    fsdp2 = fully_shard(_model(cfg, seed=0), mesh=init_device_mesh("cpu", (comm.world_size,)))
    sharded = fsdp2.state_dict()  # DTensors: this rank's rows of each parameter
    out["dcp sharded save"] = _timed(
        comm, lambda: dcp.save(sharded, storage_writer=dcp.FileSystemWriter(theirs))
    )
    by_ours = _model(cfg, seed=1)
    by_dcp = {k: torch.zeros_like(v) for k, v in state.items()}
    out["ours sharded load"] = _timed(comm, lambda: checkpoint.load(ours, by_ours, comm))
    out["dcp sharded load"] = _timed(
        comm, lambda: dcp.load(by_dcp, storage_reader=dcp.FileSystemReader(theirs))
    )
    _check_equal(state, by_ours.state_dict(), by_dcp)
    out["ours sharded bytes"], out["dcp sharded bytes"] = _disk_bytes(ours), _disk_bytes(theirs)
    return out


def checkpoint_worker(comm: Communicator, cfg: CheckpointBench, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from .. import checkpoint

    model = _model(cfg, seed=0)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {k: [] for k in ("ours save", "dcp save", "ours load", "dcp load")}
    for r in range(cfg.repeats):
        ours, theirs = os.path.join(root, f"ours{r}"), os.path.join(root, f"dcp{r}")
        out["ours save"].append(_timed(comm, lambda: checkpoint.save(ours, state, comm)))
        out["dcp save"].append(
            _timed(comm, lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(theirs)))
        )
        by_ours = {k: torch.zeros_like(v) for k, v in state.items()}
        by_dcp = {k: torch.zeros_like(v) for k, v in state.items()}
        out["ours load"].append(_timed(comm, lambda: checkpoint.load(ours, by_ours, comm)))
        out["dcp load"].append(
            _timed(comm, lambda: dcp.load(by_dcp, storage_reader=dcp.FileSystemReader(theirs)))
        )
        _check_equal(state, by_ours, by_dcp)
    out["ours bytes"], out["dcp bytes"] = _disk_bytes(ours), _disk_bytes(theirs)
    out["tensors equal"] = len(state)
    out.update(_sharded(comm, cfg, root, state))
    # the asynchronous save: the same steps with a checkpoint taken at their start, three ways
    for r in range(cfg.repeats):
        path = os.path.join(root, f"steps{r}")

        def sync_save():
            checkpoint.save(path + "sync", model, comm)
            _steps(model, cfg.steps, cfg.step_ms / 1e3)

        def async_save():
            handle = checkpoint.save(path + "async", model, comm, async_save=True)
            _steps(model, cfg.steps, cfg.step_ms / 1e3)
            handle.wait()

        out.setdefault("no save", []).append(
            _timed(comm, lambda: _steps(model, cfg.steps, cfg.step_ms / 1e3))
        )
        out.setdefault("sync save", []).append(_timed(comm, sync_save))
        out.setdefault("async save", []).append(_timed(comm, async_save))
    return out


def _spread(values: list[float]) -> str:
    return f"{min(values) * 1e3:.0f}-{max(values) * 1e3:.0f}"


def run(cfg: CheckpointBench, out: str | None = None) -> dict:
    from ..launch import launch

    root = tempfile.mkdtemp(prefix="minidist-bench-checkpoint-")
    try:
        result = launch(checkpoint_worker, cfg.world_size, args=(cfg, root), transport="torch", timeout=600)[
            0
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ms = {k: statistics.median(result[k]) * 1e3 for k in ("ours save", "dcp save", "ours load", "dcp load")}
    rows = [
        [what, f"{ms['ours ' + what]:.1f}", _spread(result["ours " + what]), f"{ms['dcp ' + what]:.1f}",
         _spread(result["dcp " + what]), ms["dcp " + what] / ms["ours " + what]]
        for what in ("save", "load")
    ]  # fmt: skip
    rows.append(["bytes on disk", human_bytes(result["ours bytes"]), "", human_bytes(result["dcp bytes"]), "",
                 result["dcp bytes"] / result["ours bytes"]])  # fmt: skip
    size = human_bytes(result["ours bytes"])
    title = f"checkpoint of a {size} decoder, {cfg.world_size} ranks (rank 0's times)"
    print_table(["", "ours ms", "min-max", "DCP ms", "min-max", "DCP / ours"], rows, title=title)
    ours_b, dcp_b = result["ours sharded bytes"], result["dcp sharded bytes"]
    print_table(
        ["sharded state", "ours ms", "DCP ms", "DCP / ours"],
        [[f"{what} ({how})", result[f"ours sharded {what}"] * 1e3, result[f"dcp sharded {what}"] * 1e3,
          result[f"dcp sharded {what}"] / result[f"ours sharded {what}"]]
         for what, how in (("save", f"{cfg.world_size} ranks"), ("load", "into the full model"))]
        + [["bytes on disk", human_bytes(ours_b), human_bytes(dcp_b), dcp_b / ours_b]],
        title="sharded: ours from ZeRO-3 (FullyShardedModule), DCP from FSDP2 (fully_shard, DTensor); "
        f"one run; loaded tensors torch.equal between the sides ({result['tensors equal']} tensors)",
    )  # fmt: skip
    base = statistics.median(result["no save"])
    print_table(
        ["steps with a checkpoint", "ms", "min-max", "/ no save"],
        [
            [k, statistics.median(result[k]) * 1e3, _spread(result[k]), statistics.median(result[k]) / base]
            for k in ("no save", "sync save", "async save")
        ],  # fmt: skip
        title=f"{cfg.steps} steps of {cfg.step_ms:g} ms emulated compute that include one save "
        f"(median of {cfg.repeats})",
    )
    record = {"config": asdict(cfg), "result": result}
    save_json(out_dir(out), "checkpoint", record)
    return record


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "checkpoint", help="minidist.checkpoint vs torch.distributed.checkpoint; async save"
    )
    d = CheckpointBench()
    parser.add_argument("--world-size", type=int, default=d.world_size)
    parser.add_argument("--hidden", type=int, default=d.hidden, help=f"decoder width (default {d.hidden})")
    parser.add_argument("--layers", type=int, default=d.layers)
    parser.add_argument("--repeats", type=int, default=d.repeats)
    parser.add_argument("--steps", type=int, default=d.steps, help="steps that include one save")
    parser.add_argument("--step-ms", type=float, default=d.step_ms, help="emulated compute per step")
    parser.add_argument("--out", default=None, help="folder for the JSON (default bench-results/)")


def main(args) -> None:
    cfg = CheckpointBench(world_size=args.world_size, hidden=args.hidden, layers=args.layers,
                          repeats=args.repeats, steps=args.steps, step_ms=args.step_ms)  # fmt: skip
    run(cfg, args.out)
