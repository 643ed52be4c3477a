"""ZeRO stage 3 (what FSDP does): every unit keeps only its flat shard and gathers its weights just in time.

Stage 3, ``FullyShardedModule(module, comm, units=None, prefetch=True)``: every "unit" (a
sub-module: the embeddings, a transformer block, the final norm) keeps only its flat shard.
Its parameters are views into a full-size buffer whose *storage is freed* (resized to 0 bytes)
except while the unit computes::

    forward   root: gather | unit0: gather, run, free | unit1: gather, run, free | ... | head
                             prefetch unit1 ->          prefetch unit2 ->
    backward  root: gather | unitK: gather, backward, reduce-scatter grad, free | ...
              ... | root: reduce-scatter, free
                             prefetch unitK-1 ->

Hooks do the work: a forward pre-hook gathers (and prefetches the next unit with an async
allgather), a forward hook frees and registers a hook on the unit's output gradient, which
gathers again (and prefetches the previous unit) just before the unit's backward;
``register_post_accumulate_grad_hook`` on the unit's parameters counts its gradients down and,
at zero, reduce-scatters the unit's flat gradient into its shard's ``.grad`` and frees the
full weights and gradients. Because the saved-for-backward tensors are views into the freed
storage, refilling that same storage before backward makes them valid again (the copy goes
through ``.data``, so autograd's version counters do not see it).

Tied weights. ``DecoderLM`` uses its word embeddings twice: in the embeddings unit and as the
output matrix in its own forward (``F.linear(h, E)``), outside every unit. Such parameters go
to the *root unit* (``shared=``; by default ``module.word_embeddings`` when the module has
that attribute). The root unit is gathered when the whole module's forward starts and freed when
it ends, then gathered again when backward starts (a hook on the outputs' gradients) and
reduce-scattered and freed when backward ends: the table is one gathered tensor for both
uses, and the traffic is still 3 psi (N-1)/N. Parameters that belong to no unit also go there.

``sharded.parameters()`` are the flat local shards (with ``.grad`` after backward): a plain
``torch.optim.AdamW(sharded.parameters())`` steps them.

To watch it work, set ``sharded.trace = []``: every unit then appends
``(time.perf_counter(), unit name, event, non-root units gathered)`` for each event, "request"
(its allgather is issued), "ready" (its full weights exist), "free" and "reduce-scatter".
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ...collectives import allgather, broadcast, reduce_scatter
from ...comm import Communicator
from .optimizer import _check_same_shapes, _distinct, _padded

__all__ = ["FullyShardedModule", "default_units"]


def default_units(module: nn.Module) -> list[nn.Module]:
    """The module's children that hold parameters; a lone such child (a wrapper like
    ``DecoderLM.transformer``) is opened, and so is a ``ModuleList`` (each block a unit).
    For ``DecoderLM``: embeddings, each block, final norm."""
    children = [c for c in module.children() if any(True for _ in c.parameters())]
    if len(children) == 1 and not isinstance(children[0], nn.ModuleList):
        return default_units(children[0])
    units = []
    for child in children:
        if isinstance(child, nn.ModuleList):
            units.extend(c for c in child if any(True for _ in c.parameters()))
        else:
            units.append(child)
    return units


class _Unit:
    """One flat-sharded group of parameters: the shard (an ``nn.Parameter``) and a full buffer
    whose storage exists only while gathered."""

    def __init__(
        self, name: str, params: list[nn.Parameter], comm: Communicator, owner: FullyShardedModule
    ) -> None:
        self.name, self.params, self.comm, self.owner = name, params, comm, owner
        world, rank = comm.world_size, comm.rank
        self.numel = sum(p.numel() for p in params)
        self.padded_numel = _padded(self.numel, world)
        n = self.padded_numel // world
        p0 = params[0]
        full = torch.zeros(self.padded_numel, dtype=p0.dtype, device=p0.device)
        self.offsets, offset = [], 0
        with torch.no_grad():
            for p in params:
                full[offset : offset + p.numel()].copy_(p.detach().view(-1))
                self.offsets.append(offset)
                offset += p.numel()
            broadcast(comm, full, 0)
        self.shard = nn.Parameter(full[rank * n : (rank + 1) * n].clone())
        self.full = torch.empty_like(full)  # a fresh buffer we own (its storage must be resizable)
        self.full.copy_(full)
        full = self.full
        for p, off in zip(params, self.offsets):
            p.data = full[off : off + p.numel()].view_as(p)
        self.pending = None  # an async allgather in flight
        self.remaining = len(params)  # gradients still to arrive in this backward
        self.free()

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def start_gather(self) -> None:
        if not self.gathered and self.pending is None:
            self.pending = allgather(self.comm, self.shard.detach(), async_op=True)
            self.owner._trace(self, "request")

    def gather(self) -> None:
        if self.gathered:
            return
        self.start_gather()
        rows = self.pending.wait()
        self.pending = None
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        self.full.data.copy_(rows.view(-1))  # through .data: no version bump for saved tensors
        self.owner._note_gathered(self)
        self.owner._trace(self, "ready")

    def free(self) -> None:
        held = self.gathered or self.pending is not None
        if self.pending is not None:  # never leave a collective behind
            self.pending.wait()
            self.pending = None
        self.full.untyped_storage().resize_(0)
        if held:
            self.owner._trace(self, "free")

    def reduce_gradient(self) -> None:
        self.owner._trace(self, "reduce-scatter")
        world = self.comm.world_size
        pieces = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).view(-1) for p in self.params
        ]
        if self.padded_numel > self.numel:
            pieces.append(self.shard.new_zeros(self.padded_numel - self.numel))
        flat = torch.cat(pieces).view(world, -1)
        for p in self.params:
            p.grad = None
        averaged = reduce_scatter(self.comm, flat, op="avg").view(-1)
        del flat
        if self.shard.grad is None:
            self.shard.grad = averaged
        else:
            self.shard.grad += averaged
        self.remaining = len(self.params)
        self.free()


class FullyShardedModule(nn.Module):
    """ZeRO stage 3: ``sharded(*args)`` runs ``module`` with just-in-time gathered parameters.

    Args:
        module: the model (the same on every rank; rank 0's weights are broadcast).
        comm: this rank's communicator.
        units: sub-modules to shard one by one (default ``default_units(module)``).
        prefetch: start the next unit's allgather (async) while the current one computes.
        shared: parameters used outside their unit (tied weights); they join the root unit.
            Default: ``module.word_embeddings`` if the module has such a Parameter.

    ``parameters()`` yields the flat shards only. ``peak_gathered_units`` is the largest number
    of (non-root) units whose full weights were materialised at the same time. ``trace``: None,
    or a list that receives every unit's events (see the module docstring).
    """

    def __init__(
        self, module: nn.Module, comm: Communicator, units=None, prefetch: bool = True, shared=None
    ) -> None:
        super().__init__()
        object.__setattr__(self, "module", module)  # not a sub-module: parameters() are the shards
        self.comm, self.prefetch = comm, prefetch
        self.trace: list | None = None  # a list here records every unit's events (module docstring)
        units = list(default_units(module) if units is None else units)
        if shared is None:
            tied = (
                getattr(module, "word_embeddings", None) if hasattr(type(module), "word_embeddings") else None
            )
            shared = [tied] if isinstance(tied, nn.Parameter) else []
        shared_ids = {id(p) for p in shared}
        claimed = set(shared_ids)
        groups = []
        for i, unit in enumerate(units):
            params = [p for p in _distinct(unit.parameters()) if id(p) not in claimed]
            claimed.update(id(p) for p in params)
            groups.append((f"unit{i}:{type(unit).__name__}", unit, params))
        root_params = [
            p for p in _distinct(module.parameters()) if id(p) not in claimed or id(p) in shared_ids
        ]
        root_params = _distinct(list(shared) + root_params)
        everything = [p for _, _, ps in groups for p in ps] + root_params
        _check_same_shapes(comm, everything, "FullyShardedModule")
        self.root = _Unit("root", root_params, comm, self) if root_params else None
        self.units: list[_Unit] = []
        for name, unit, params in groups:
            if not params:
                continue
            u = _Unit(name, params, comm, self)
            self.units.append(u)
            unit.register_forward_pre_hook(lambda m, a, u=u: self._pre_forward(u))
            unit.register_forward_hook(lambda m, a, out, u=u: self._post_forward(u, out))
        for u in self.all_units:
            for p in u.params:
                p.register_post_accumulate_grad_hook(lambda p, u=u: self._grad_ready(u))
        self.shards = nn.ParameterList([u.shard for u in self.all_units])
        self.padded_numel = sum(u.padded_numel for u in self.all_units)
        self.numel = sum(u.numel for u in self.all_units)
        self.forward_order: list[_Unit] = []
        self.peak_gathered_units = 0
        self._in_backward = False

    @property
    def all_units(self) -> list[_Unit]:
        return ([self.root] if self.root else []) + self.units

    def gathered_units(self) -> int:
        """Non-root units whose full weights exist right now."""
        return sum(u.gathered or u.pending is not None for u in self.units)

    def _note_gathered(self, unit) -> None:
        self.peak_gathered_units = max(self.peak_gathered_units, self.gathered_units())

    def _trace(self, unit: _Unit, event: str) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), unit.name, event, self.gathered_units()))

    # --- forward ---------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.forward_order = []
        if self.root:
            self.root.gather()
        if self.prefetch and self.units:
            self.units[0].start_gather()
        out = self.module(*args, **kwargs)
        if self.root:
            self.root.free()
        self._hook_outputs(out, self._pre_backward_root)
        return out

    def _pre_forward(self, unit: _Unit) -> None:
        unit.gather()
        self.forward_order.append(unit)
        if self.prefetch:
            i = self.units.index(unit)
            if i + 1 < len(self.units):
                self.units[i + 1].start_gather()
                self._note_gathered(None)

    def _post_forward(self, unit: _Unit, out) -> None:
        unit.free()
        if torch.is_grad_enabled():
            self._hook_outputs(out, lambda grad, u=unit: self._pre_backward(u))

    @staticmethod
    def _hook_outputs(out, fn) -> None:
        tensors = out if isinstance(out, (tuple, list)) else [out]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(fn)

    # --- backward --------------------------------------------------------------
    def _pre_backward_root(self, grad) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            if self.root:
                self.root.gather()
            if self.prefetch and self.forward_order:
                self.forward_order[-1].start_gather()
                self._note_gathered(None)

    def _pre_backward(self, unit: _Unit) -> None:
        unit.gather()
        if self.prefetch:
            i = self.forward_order.index(unit)
            if i > 0:
                self.forward_order[i - 1].start_gather()
                self._note_gathered(None)

    def _grad_ready(self, unit: _Unit) -> None:
        unit.remaining -= 1
        if unit.remaining == 0 and unit is not self.root:
            unit.reduce_gradient()

    def _end_backward(self) -> None:
        """Units whose gradients did not all arrive (unused parameters), then the root, in a fixed order."""
        for unit in self.units:
            if unit.remaining != len(unit.params):
                unit.reduce_gradient()
            unit.free()
        if self.root:
            self.root.reduce_gradient()
        self._in_backward = False

    def held_tensors(self) -> dict:
        return {
            "params": [u.shard.detach() for u in self.all_units] + [u.full for u in self.all_units],
            "grads": [u.shard.grad for u in self.all_units if u.shard.grad is not None],
        }

    # --- helpers for tests and notebooks -------------------------------------
    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter of the module, gathered (collective: call on every rank)."""
        out = {}
        names = {id(p): n for n, p in self.module.named_parameters()}
        for u in self.all_units:
            rows = allgather(self.comm, u.shard.detach()).view(-1)
            for p, off in zip(u.params, u.offsets):
                out[names[id(p)]] = rows[off : off + p.numel()].view(p.shape).clone()
        return out
