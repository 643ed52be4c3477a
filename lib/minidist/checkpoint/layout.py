"""Where each rank's tensors sit inside the global ones: the *slots* a rank saves or loads.

A slot is (global name, global shape, dtype, region, local tensor). The region says which part
of the global tensor the local tensor is, in one of two forms:

    Box(offsets, sizes)   a block: rows [o0, o0+s0) x columns [o1, o1+s1) x ...
                          replicated tensor: offsets 0, sizes = the shape (every rank has it)
                          ColumnParallelLinear.weight, VocabParallelEmbedding.weight and
                          ColumnParallelLinear.bias: rows [r d/p, (r+1) d/p)
                          RowParallelLinear.weight: columns [r d_in/p, (r+1) d_in/p)
    Flat(start, stop)     elements [start, stop) of the tensor read row-major as one vector:
                          ZeRO cuts a flat concatenation of many tensors, so a rank's shard is
                          a tail of one tensor, some whole tensors, and a head of the next

ZeRO's flat shards, for a unit of tensors A (6 elements) and B (5), 4 ranks, padded to 12::

    flat       [ A0 A1 A2 | A3 A4 A5 | B0 B1 B2 | B3 B4 pad ]
    rank 0     A Flat(0, 3)          rank 2     B Flat(0, 3)
    rank 1     A Flat(3, 6)          rank 3     B Flat(3, 5)  + 1 padding element (not saved)

``slots(obj, comm)`` reads the layout from the objects themselves: a plain ``nn.Module`` or
tensor (replicated), the tensor-parallel layers of ``minidist.parallel.tensor`` (a box per
shard), ``zero.FullyShardedModule`` (flat ranges of each unit's shard), ``zero.ZeroOptimizer``
(flat ranges of its AdamW moments, and the step as a replicated scalar), an optimizer such as
``torch.optim.AdamW`` over a model's parameters or a ZeRO-3 model's shards (its state laid out
like the parameters), or a dict of those (names prefixed by the key).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Communicator
from ..parallel import tensor as tp
from ..parallel.zero import FullyShardedModule, ZeroOptimizer


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "sizes": list(self.sizes)}


@dataclass(frozen=True)
class Flat:
    start: int
    stop: int

    def to_json(self) -> dict:
        return {"flat": [self.start, self.stop]}


def region_from_json(d: dict) -> Box | Flat:
    if "flat" in d:
        return Flat(*d["flat"])
    return Box(tuple(d["offsets"]), tuple(d["sizes"]))


@dataclass
class Slot:
    name: str
    shape: tuple[int, ...]  # the global tensor's
    dtype: torch.dtype
    region: Box | Flat
    tensor: torch.Tensor  # this rank's part (a view into the live storage: load writes through it)


@dataclass
class Layout:
    slots: list[Slot] = field(default_factory=list)
    pads: list[torch.Tensor] = field(default_factory=list)  # ZeRO padding: zeroed on load
    groups: dict = field(default_factory=dict)  # flat groups: numel, padding (for metadata.json)
    optimizers: dict = field(default_factory=dict)  # prefix -> state keys (for metadata.json)
    names: set = field(default_factory=set)  # every global name, also those this rank holds none of


def full_box(t: torch.Tensor) -> Box:
    return Box((0,) * t.dim(), tuple(t.shape))


def _tp_split_dims(module: nn.Module) -> dict[int, tuple[int, Communicator]]:
    """id(parameter) -> (split dimension, the layer's communicator) for the tensor-parallel layers."""
    dims = {}
    for m in module.modules():
        if isinstance(m, (tp.ColumnParallelLinear, tp.VocabParallelEmbedding)):
            for p in (m.weight, getattr(m, "bias", None)):
                if p is not None:
                    dims[id(p)] = (0, m.comm)
        elif isinstance(m, tp.RowParallelLinear):
            dims[id(m.weight)] = (1, m.comm)  # its bias is replicated
    return dims


def _module(module: nn.Module, prefix: str, out: Layout) -> None:
    if isinstance(module, FullyShardedModule):
        return _fully_sharded(module, prefix, out)
    split = _tp_split_dims(module)
    for name, t in module.state_dict(keep_vars=True).items():
        split_dim = split.get(id(t))  # keep_vars: the Parameter objects themselves
        t = t.detach()
        if split_dim is None:
            out.slots.append(Slot(prefix + name, tuple(t.shape), t.dtype, full_box(t), t))
            continue
        dim, comm = split_dim
        shape, offsets = list(t.shape), [0] * t.dim()
        offsets[dim] = comm.rank * t.shape[dim]
        shape[dim] *= comm.world_size
        region = Box(tuple(offsets), tuple(t.shape))
        out.slots.append(Slot(prefix + name, tuple(shape), t.dtype, region, t))


def _flat(names, shapes, offsets, local: torch.Tensor, rank: int, world: int, group: str, out: Layout):
    """Slots of one flat shard: rank ``rank`` holds elements [rank n, (rank+1) n) of the flat vector."""
    n = local.numel()
    lo, hi = rank * n, (rank + 1) * n
    end = 0
    for name, shape, off in zip(names, shapes, offsets):
        numel = math.prod(shape)
        end = max(end, off + numel)
        out.names.add(name)
        a, b = max(lo, off), min(hi, off + numel)
        if a < b:
            region = Flat(a - off, b - off)
            out.slots.append(Slot(name, tuple(shape), local.dtype, region, local[a - lo : b - lo]))
    if max(lo, end) < hi:
        out.pads.append(local[max(lo, end) - lo :])
    out.groups[group] = {"numel": end, "padded_numel": n * world, "padding": n * world - end}


def _units(sharded: FullyShardedModule, prefix: str) -> list[tuple]:
    """(unit, names, shapes, offsets) of each flat unit; a tied table has two names (both saved)."""
    names_of: dict[int, list[str]] = {}
    for name, t in sharded.module.state_dict(keep_vars=True).items():
        names_of.setdefault(id(t), []).append(prefix + name)
    units = []
    for unit in sharded.all_units:
        members = [
            (n, tuple(p.shape), off) for p, off in zip(unit.params, unit.offsets) for n in names_of[id(p)]
        ]
        units.append((unit, *map(list, zip(*members))))
    return units


def _fully_sharded(sharded: FullyShardedModule, prefix: str, out: Layout) -> None:
    comm = sharded.comm
    for unit, names, shapes, offsets in _units(sharded, prefix):
        local = unit.shard.detach()
        _flat(names, shapes, offsets, local, comm.rank, comm.world_size, prefix + unit.name, out)
    managed = {id(p) for unit in sharded.all_units for p in unit.params}
    for name, t in sharded.module.state_dict(keep_vars=True).items():
        if id(t) not in managed:  # buffers, frozen parameters: replicated
            t = t.detach()
            out.slots.append(Slot(prefix + name, tuple(t.shape), t.dtype, full_box(t), t))


def _zero_optimizer(opt: ZeroOptimizer, prefix: str, names: dict, saved: dict | None, out: Layout) -> None:
    """AdamW's exp_avg / exp_avg_sq of the flat shard, cut at the parameters; the step, replicated
    (under every parameter's name, as a plain optimizer keeps it: the two load into each other).

    Before its first step an optimizer has no state: for a load, the keys saved in the
    checkpoint (``saved``) are created first (zeros of the shard's shape, or a scalar)."""
    state = opt.inner.state.setdefault(opt.shard, {})
    for key, kind in (saved or {}).items():
        state.setdefault(key, torch.zeros_like(opt.shard.detach()) if kind == "param" else torch.zeros(()))
    kinds = {
        k: "param" if v.shape == opt.shard.shape else "scalar" for k, v in state.items() if torch.is_tensor(v)
    }
    out.optimizers[prefix] = {"per_parameter": kinds}
    pnames = [names.get(id(p), f"param{i}") for i, p in enumerate(opt.params)]
    shapes = [tuple(p.shape) for p in opt.params]
    comm = opt.comm
    for key, kind in kinds.items():
        keyed = [f"{prefix}{key}.{n}" for n in pnames]
        if kind == "param":
            _flat(keyed, shapes, opt.offsets, state[key], comm.rank, comm.world_size, prefix + key, out)
        else:
            t = state[key].detach()
            out.slots.extend(Slot(name, tuple(t.shape), t.dtype, full_box(t), t) for name in keyed)


def _optimizer(opt, prefix: str, names: dict, shards: dict, saved: dict | None, out: Layout) -> None:
    """A plain optimizer (torch.optim.AdamW, ...) over a model's parameters or over the flat shards
    of a ``FullyShardedModule``: each state tensor is laid out like its parameter (replicated, or
    the unit's flat ranges, cut at the unit's parameters); a scalar (AdamW's step) is replicated.
    Before its first step an optimizer has no state: for a load, the saved keys are created."""
    kinds = {}
    for i, p in enumerate(q for group in opt.param_groups for q in group["params"]):
        state = opt.state.setdefault(p, {}) if saved else opt.state.get(p, {})
        for key, kind in (saved or {}).items():
            state.setdefault(key, torch.zeros_like(p.detach()) if kind == "param" else torch.zeros(()))
        for key, t in state.items():
            if not torch.is_tensor(t):
                continue
            kinds[key] = "param" if t.shape == p.shape and t.dim() else "scalar"
            if id(p) not in shards:
                name = f"{prefix}{key}.{names.get(id(p), f'param{i}')}"
                out.slots.append(Slot(name, tuple(t.shape), t.dtype, full_box(t), t.detach()))
                continue
            unit, comm, pnames, shapes, offsets = shards[id(p)]  # a ZeRO-3 unit's shard: its flat ranges
            keyed = [f"{prefix}{key}.{n}" for n in pnames]
            if kinds[key] == "param":
                group = f"{prefix}{key}.{unit.name}"
                _flat(keyed, shapes, offsets, t.detach(), comm.rank, comm.world_size, group, out)
            else:  # the unit's step, under each of its parameters' names
                out.slots.extend(Slot(n, tuple(t.shape), t.dtype, full_box(t), t.detach()) for n in keyed)
    out.optimizers[prefix] = {"per_parameter": kinds}


def layout(obj, saved_optimizers: dict | None = None) -> Layout:
    """Every slot of ``obj`` on this rank (see the module docstring for what ``obj`` may be)."""
    out = Layout()
    items = obj.items() if isinstance(obj, dict) else [("", obj)]
    names, shards = {}, {}  # parameter -> name (optimizer state is named after the model's parameters)
    for key, value in items:
        prefix = f"{key}." if key else ""
        if isinstance(value, FullyShardedModule):
            for unit, pnames, shapes, offsets in _units(value, prefix):
                shards[id(unit.shard)] = (unit, value.comm, pnames, shapes, offsets)
        module = value.module if isinstance(value, FullyShardedModule) else value
        if isinstance(module, nn.Module):
            for n, p in module.named_parameters():
                names[id(p)] = prefix + n
    for key, value in items:
        prefix = f"{key}." if key else ""
        saved = (saved_optimizers or {}).get(prefix, {}).get("per_parameter")
        if isinstance(value, nn.Module):
            _module(value, prefix, out)
        elif isinstance(value, ZeroOptimizer):
            _zero_optimizer(value, prefix, names, saved, out)
        elif hasattr(value, "param_groups") and hasattr(value, "state"):
            _optimizer(value, prefix, names, shards, saved, out)
        elif isinstance(value, torch.Tensor):
            t = value.detach()
            out.slots.append(Slot(key, tuple(t.shape), t.dtype, full_box(t), t))
        elif isinstance(value, dict) and key:
            inner = layout({f"{key}.{k}": v for k, v in value.items()}, saved_optimizers)
            for part in ("slots", "pads"):
                getattr(out, part).extend(getattr(inner, part))
            out.names |= inner.names
            out.groups.update(inner.groups)
            out.optimizers.update(inner.optimizers)
        else:
            raise TypeError(
                f"checkpoint: {key or 'the object'} is a {type(value).__name__}; pass an nn.Module, "
                "a tensor, a FullyShardedModule, a ZeroOptimizer, an optimizer, or a dict of those"
            )
    out.names |= {s.name for s in out.slots}
    names_seen = [s.name for s in out.slots]
    if len(set(names_seen)) != len(names_seen):
        dup = next(n for n in names_seen if names_seen.count(n) > 1)
        raise ValueError(f"checkpoint: two tensors are both named {dup!r}; give them distinct keys")
    return out
