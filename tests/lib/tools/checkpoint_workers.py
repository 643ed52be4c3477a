"""Workers for test_checkpoint.py: one save launch at 4 ranks, one load launch per world size.

The saved state: a small two-layer model under ZeRO-3 (units of 35 and 18 elements: padded at
2, 3 and 4 ranks), the same model under ZeRO-2 with its AdamW moments, and a tensor-parallel
decoder (heads, vocabulary and ffn divisible by 2, 3 and 4) built from a dense one.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import torch
import torch.nn.functional as F
from torch import nn

from minidist import checkpoint
from minidist.checkpoint.layout import layout
from minidist.collectives import allgather
from minidist.models.decoder import DecoderLM
from minidist.models.tp_decoder import TensorParallelDecoderLM
from minidist.models.transformer import TransformerConfig
from minidist.parallel.zero import FullyShardedModule, ZeroOptimizer

CFG = TransformerConfig(
    vocab_size=24, hidden_size=24, n_layers=1, n_heads=12, max_positions=8, causal=True, pre_ln=True
)


class Small(nn.Module):
    """35 + 18 parameters and a buffer: ZeRO pads each unit (and the 53-element whole) at 2, 3, 4 ranks."""

    def __init__(self, hidden: int = 5) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, hidden), nn.Linear(hidden, 3)
        self.register_buffer("scale", torch.tensor([2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))) * self.scale[0]


def small(seed: int, hidden: int = 5) -> Small:
    torch.manual_seed(seed)
    return Small(hidden)


def dense(seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(CFG)


class PlainAdamW:
    """torch.optim.AdamW's update written out, with the state it keeps (step, exp_avg, exp_avg_sq).

    Why not torch's: constructing any torch.optim optimizer imports torch._dynamo (about 800
    modules, 2 CPU-seconds) in every worker process; this keeps the test's launches cheap."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01) -> None:
        group = {"params": list(params), "lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.param_groups, self.state = [group], {}

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            zeros = torch.zeros_like(p)
            s = self.state.setdefault(
                p, {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}
            )
            s["step"] += 1
            t = float(s["step"])
            p.mul_(1 - group["lr"] * group["weight_decay"])
            s["exp_avg"].lerp_(p.grad, 1 - beta1)
            s["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (s["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["eps"])
            p.addcdiv_(s["exp_avg"], denom, value=-group["lr"] / (1 - beta1**t))

    def zero_grad(self) -> None:
        for p in self.param_groups[0]["params"]:
            p.grad = None


def train_step(model: nn.Module, opt, rank: int) -> None:
    torch.manual_seed(100 + rank)  # every rank its own batch
    loss = F.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3))
    loss.backward()
    opt.step()
    opt.zero_grad()


def zero_moments(opt: ZeroOptimizer, names: list[str]) -> dict:
    """The full AdamW moments of a ZeroOptimizer, gathered (the reference for a resharded load)."""
    state = opt.state[opt.shard]
    out = {"step": state["step"].clone()}
    for key in ("exp_avg", "exp_avg_sq"):
        flat = allgather(opt.comm, state[key]).view(-1)
        for name, p, off in zip(names, opt.params, opt.offsets):
            out[f"{key}.{name}"] = flat[off : off + p.numel()].view(p.shape).clone()
    return out


def plain_moments(model: nn.Module, opt) -> dict:
    """An optimizer's state per parameter name: over a FullyShardedModule's shards (gathered and cut
    at the parameters), or over a plain model's parameters."""
    out = {}
    if isinstance(model, FullyShardedModule):
        names = {id(p): n for n, p in model.module.named_parameters()}
        for unit in model.all_units:
            state = opt.state[unit.shard]
            for key in ("exp_avg", "exp_avg_sq"):
                flat = allgather(model.comm, state[key]).view(-1)
                for p, off in zip(unit.params, unit.offsets):
                    out[f"{key}.{names[id(p)]}"] = flat[off : off + p.numel()].view(p.shape).clone()
            out.update({f"step.{names[id(p)]}": state["step"].clone() for p in unit.params})
        return out
    for name, p in model.named_parameters():
        out.update({f"{key}.{name}": t.clone() for key, t in opt.state[p].items()})
    return out


def clone(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


def save_at_four(comm, path: str) -> dict:
    """Save ZeRO-3, ZeRO-2 (+ moments) and TP at 4 ranks; an async save, then a step while it writes."""
    sharded = FullyShardedModule(small(0), comm)
    opt3 = PlainAdamW(sharded.parameters(), lr=0.1)
    train_step(sharded, opt3, comm.rank)
    plain = small(0)
    zopt = ZeroOptimizer(plain.parameters(), comm, stage=2, optimizer=PlainAdamW, lr=0.1)
    train_step(plain, zopt, comm.rank)
    tp_model = TensorParallelDecoderLM.from_dense(dense(), comm)
    state = {"fsdp": sharded, "fsdp_optim": opt3, "zero": plain, "zero_optim": zopt, "tp": tp_model}
    checkpoint.save(os.path.join(path, "sync"), state, comm)
    fsdp_moments = plain_moments(sharded, opt3)
    # the background write is held until the step below has changed the parameters: only the
    # snapshot taken by save() can keep the old values
    gate, write = threading.Event(), checkpoint.save_file
    checkpoint.save_file = lambda tensors, file: (gate.wait(30), write(tensors, file))
    handle = checkpoint.save(os.path.join(path, "async"), {"fsdp": sharded}, comm, async_save=True)
    before = sharded.full_state()
    train_step(sharded, opt3, comm.rank)
    gate.set()
    handle.wait()
    checkpoint.save_file = write
    names = [n for n, _ in plain.named_parameters()]
    return {
        "fsdp": {**before, "scale": plain.scale.clone()},
        "fsdp_after": sharded.full_state(),
        "fsdp_optim": fsdp_moments,
        "zero": clone(plain.state_dict()),
        "zero_optim": zero_moments(zopt, names),
    }


def equal(got: dict, want: dict) -> list[str]:
    """Names whose tensors differ (or are missing): [] when every tensor is bit-equal."""
    return [k for k in want if k not in got or not torch.equal(got[k], want[k])]


def _padding(unit, rank: int) -> torch.Tensor:
    """The padding elements of this rank's shard of a ZeRO-3 unit (a view)."""
    n = unit.shard.numel()
    return unit.shard.detach()[min(max(unit.numel - rank * n, 0), n) :]


def load_at(comm, path: str, ref: dict) -> dict:
    """Load the 4-rank save into this world size (1: plain modules, the full model) and compare."""
    world, out = comm.world_size, {}
    fsdp = FullyShardedModule(small(1), comm) if world > 1 else small(1)
    plain = small(2)
    zopt = ZeroOptimizer(plain.parameters(), comm, stage=2, optimizer=PlainAdamW, lr=0.1)
    tp_model = TensorParallelDecoderLM(CFG, comm) if world > 1 else dense(seed=3)
    fsdp_opt = PlainAdamW(fsdp.parameters(), lr=0.1)  # no state yet: load creates it
    state = {"fsdp": fsdp, "fsdp_optim": fsdp_opt, "zero": plain, "zero_optim": zopt, "tp": tp_model}
    pads = [_padding(u, comm.rank) for u in fsdp.all_units] if world > 1 else []
    for pad in pads:
        pad.fill_(7.0)  # load must zero the new shards' padding
    out["bytes_read"] = checkpoint.load(os.path.join(path, "sync"), state, comm)
    out["bytes_held"] = sum(s.tensor.numel() * s.tensor.element_size() for s in layout(state).slots)
    got = fsdp.full_state() | {"scale": fsdp.module.scale} if world > 1 else fsdp.state_dict()
    out["fsdp"] = equal(got, ref["fsdp"])
    out["fsdp_padding"] = [pad.tolist() for pad in pads]
    out["fsdp_optim"] = equal(plain_moments(fsdp, fsdp_opt), ref["fsdp_optim"])
    out["zero"] = equal(plain.state_dict(), ref["zero"])
    names = [n for n, _ in plain.named_parameters()]
    out["zero_optim"] = equal(zero_moments(zopt, names), ref["zero_optim"])
    want_tp = TensorParallelDecoderLM.from_dense(dense(), comm) if world > 1 else dense()
    out["tp"] = equal(tp_model.state_dict(), want_tp.state_dict())
    out["tp_names"] = len(want_tp.state_dict())
    # the tensor-parallel save loaded into ZeRO-3 (blocks in, flat ranges out)
    other = FullyShardedModule(dense(seed=4), comm)
    checkpoint.load(os.path.join(path, "sync"), {"tp": other}, comm, strict=False)
    out["tp_into_zero3"] = equal(other.full_state(), dict(dense().named_parameters()))
    if world == 1:
        out.update(async_and_errors(comm, path, ref))
    return out


def async_and_errors(comm, path: str, ref: dict) -> dict:
    """The async save equals the sync save of the same step; a mismatched model is refused."""
    from_async, from_sync = small(5), small(6)
    checkpoint.load(os.path.join(path, "async"), {"fsdp": from_async}, comm)
    checkpoint.load(os.path.join(path, "sync"), {"fsdp": from_sync}, comm, strict=False)
    # the ZeRO-2 optimizer's state into a plain optimizer over a plain model (the same names)
    model = small(7)
    opt = PlainAdamW(model.parameters(), lr=0.1)
    checkpoint.load(os.path.join(path, "sync"), {"zero": model, "zero_optim": opt}, comm, strict=False)
    moments = plain_moments(model, opt)
    steps = [moments.pop(k) for k in list(moments) if k.startswith("step.")]
    want = {k: v for k, v in ref["zero_optim"].items() if k != "step"}
    out = {
        "zero_into_plain": equal(moments, want)
        + [s for s in steps if not torch.equal(s, ref["zero_optim"]["step"])],
        "async_vs_sync": equal(from_async.state_dict(), from_sync.state_dict()),
        "async_vs_after": equal(dict(from_async.named_parameters()), ref["fsdp_after"]),
    }
    try:
        checkpoint.load(os.path.join(path, "sync"), {"fsdp": small(0, hidden=4)}, comm, strict=False)
        out["mismatch"] = None
    except ValueError as error:
        out["mismatch"] = str(error)
    try:
        checkpoint.load(os.path.join(path, "nothing-here"), small(0), comm)
        out["missing"] = None
    except FileNotFoundError as error:
        out["missing"] = str(error)
    return out | missing_piece(comm, path) | overwrite_and_unwaited(comm, path)


def _error(fn) -> str | None:
    """The message of what ``fn()`` raises (its type first), or None if it returns."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 (the test reads the type and message)
        return f"{type(error).__name__}: {error}"
    return None


def missing_piece(comm, path: str) -> dict:
    """A copy of the tensor-parallel save without rank 1's file, loaded into ZeRO-3 (blocks in,
    flat out): first with metadata.json intact (the file is missing), then with rank 1's pieces
    dropped from it too (a gap in the coverage, which the cross-form load must not fill with garbage)."""
    copy = os.path.join(path, "missing-piece")
    shutil.copytree(os.path.join(path, "sync"), copy)
    os.remove(os.path.join(copy, "rank00001.safetensors"))
    into = lambda: checkpoint.load(copy, {"tp": FullyShardedModule(dense(seed=4), comm)}, comm, strict=False)  # noqa: E731
    out = {"missing_file": _error(into)}
    with open(os.path.join(copy, "metadata.json")) as f:
        meta = json.load(f)
    for entry in meta["tensors"].values():
        entry["pieces"] = [p for p in entry["pieces"] if p["file"] != "rank00001.safetensors"]
    with open(os.path.join(copy, "metadata.json"), "w") as f:
        json.dump(meta, f)
    out["missing_piece"] = _error(into)
    return out


def overwrite_and_unwaited(comm, path: str) -> dict:
    """save() into a directory that holds a checkpoint: refused, then overwrite=True with a write
    that fails (the old checkpoint must still load), then one that succeeds (the new one loads,
    the old files are gone); and a save while an async save was not waited on."""
    where, out = os.path.join(path, "overwrite"), {}
    checkpoint.save(where, small(0), comm)
    out["exists"] = _error(lambda: checkpoint.save(where, small(8), comm))
    write = checkpoint.save_file

    def dies(tensors, file):
        raise OSError("disk gone")

    checkpoint.save_file = dies
    out["dies"] = _error(lambda: checkpoint.save(where, small(8), comm, overwrite=True))
    checkpoint.save_file = write
    loaded = small(9)
    checkpoint.load(where, loaded, comm)
    out["after_death"] = equal(loaded.state_dict(), small(0).state_dict())
    checkpoint.save(where, small(8), comm, overwrite=True)
    checkpoint.load(where, loaded, comm)
    out["overwritten"] = equal(loaded.state_dict(), small(8).state_dict())
    out["files"] = sorted(os.listdir(where))
    handle = checkpoint.save(os.path.join(path, "a1"), small(0), comm, async_save=True)
    out["unwaited"] = _error(lambda: checkpoint.save(os.path.join(path, "a2"), small(0), comm))
    handle.wait()
    out["after_wait"] = _error(lambda: checkpoint.save(os.path.join(path, "a2"), small(0), comm))
    return out
