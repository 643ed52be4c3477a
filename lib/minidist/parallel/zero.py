"""ZeRO from scratch: shard the optimizer state (stage 1), the gradients (stage 2), the parameters (stage 3).

Data parallelism keeps N full copies of everything. Per parameter, mixed-precision-free fp32 AdamW
holds 4 bytes of weight, 4 of gradient and 8 of optimizer state (exp_avg, exp_avg_sq). ZeRO
(Rajbhandari et al., 2020) splits a *flat* vector of all parameters into N equal shards
(padded to a multiple of N) and gives each rank the responsibility for one::

    flat parameters  [ shard 0 | shard 1 | shard 2 | shard 3 | pad ]
    rank r           keeps optimizer state (stage 1), gradient (stage 2), weights (stage 3)
                     for shard r only

    bytes per rank (psi parameters, fp32, AdamW)        traffic per rank per step
    stage 1   4 psi + 4 psi     + 8 psi / N              reduce-scatter + allgather   2 psi (N-1)/N
    stage 2   4 psi + 4 psi / N + 8 psi / N              reduce-scatter + allgather   2 psi (N-1)/N
    stage 3   (4 + 4 + 8) psi / N (+ 2 gathered units)   allgather x2 + reduce-scatter 3 psi (N-1)/N

(traffic in elements; times the dtype's bytes. The paper's 2psi/2psi/3psi is the large-N limit.)

Stages 1 and 2, ``ZeroOptimizer(params, comm, stage, optimizer=torch.optim.AdamW, **kw)``::

    loss.backward()       every rank: full gradient of its own batch
    opt.step()            1. reduce-scatter(avg) of the flat gradient: rank r gets the averaged shard r
                          2. the inner optimizer steps shard r only (its state is 1/N of the model's)
                          3. allgather of the updated shards: every rank has all weights again
    opt.zero_grad()

The model's parameters become views into one flat buffer, so step 3 writes them in place.
Stage 1 could allreduce the whole gradient instead (every rank then has all of it), but only
shard r is used on rank r: a reduce-scatter gives it for half the traffic of an allreduce, so
the step costs what plain DDP's allreduce costs, 2 psi (N-1)/N -- the paper's point.
Stage 1 keeps the full gradient buffer (``p.grad`` are views of it; after the step only the
rank's own slice holds the average). Stage 2 frees the full gradients after the reduce-scatter
and keeps only the averaged shard. (Here the reduce-scatter runs after backward, so the full
gradients still exist during backward; DeepSpeed reduces buckets during backward instead.)

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
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
from torch import nn

from ..collectives import allgather, broadcast, reduce_scatter
from ..comm import Communicator

__all__ = ["FullyShardedModule", "ZeroOptimizer", "default_units", "memory_formula", "traffic_formula"]

STAGES = (1, 2, 3)


def traffic_formula(stage: int, n_params: int, world: int, dtype_bytes: int = 4) -> float:
    """Payload bytes each rank sends per step with ring collectives (``comm.stats.bytes_sent``).

    Stages 1 and 2: reduce-scatter + allgather, 2 psi (N-1)/N elements. Stage 3: allgather in
    forward, again in backward, reduce-scatter: 3 psi (N-1)/N. Large N: 2 psi, 2 psi, 3 psi.
    ``n_params`` is the padded count (a multiple of ``world``) to match the counter exactly.
    """
    _check_stage(stage, STAGES)
    factor = 2 if stage in (1, 2) else 3
    return factor * n_params * (world - 1) / world * dtype_bytes


def memory_formula(
    stage: int, n_params: int, world: int, dtype_bytes: int = 4, state_per_param: int = 2
) -> dict:
    """Bytes held per rank after a step: params, grads, optimizer state (Adam: 2 values per param)."""
    _check_stage(stage, STAGES)
    psi = n_params * dtype_bytes
    return {
        "params": psi / world if stage >= 3 else psi,
        "grads": psi / world if stage >= 2 else psi,
        "optimizer": state_per_param * psi / world,
    }


def _check_stage(stage, allowed) -> None:
    if isinstance(stage, bool) or stage not in allowed:
        raise ValueError(f"ZeRO stage must be one of {allowed}, got {stage!r}")


def _padded(n: int, world: int) -> int:
    return -(-n // world) * world


def _check_same_shapes(comm: Communicator, params: list[torch.Tensor], what: str) -> None:
    """Once at construction: every rank must shard the same list of shapes (else shards would not line up)."""
    signature = repr([tuple(p.shape) for p in params])
    mine = torch.tensor([len(params), sum(p.numel() for p in params), zlib.crc32(signature.encode())])
    rows = allgather(comm, mine)
    for rank in range(comm.world_size):
        if not torch.equal(rows[rank], rows[0]):
            raise ValueError(
                f"{what}: rank {rank} has {int(rows[rank, 0])} parameters with "
                f"{int(rows[rank, 1])} elements, "
                f"rank 0 has {int(rows[0, 0])} with {int(rows[0, 1])} (or different shapes): every rank must "
                "build the same model"
            )


def _distinct(params: Iterable[torch.Tensor]) -> list[nn.Parameter]:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append(p)
    return out


class ZeroOptimizer:
    """ZeRO stage 1 or 2 around any elementwise optimizer (AdamW, Adam, SGD...).

    Args:
        params: the model's parameters (the same shapes, in the same order, on every rank).
        comm: this rank's communicator; every rank of it takes part.
        stage: 1 (optimizer state sharded) or 2 (+ gradients sharded).
        optimizer: the inner optimizer class, built over this rank's flat shard only.
        **kwargs: passed to ``optimizer`` (lr, weight_decay, ...).

    Rank 0's parameters are broadcast at construction so every rank starts equal.
    """

    def __init__(
        self, params, comm: Communicator, stage: int = 1, optimizer=torch.optim.AdamW, **kwargs
    ) -> None:
        _check_stage(stage, (1, 2))
        self.comm, self.stage = comm, stage
        self.params = _distinct(params)
        if not self.params:
            raise ValueError("ZeroOptimizer got no parameters that require grad")
        _check_same_shapes(comm, self.params, "ZeroOptimizer")
        world, rank = comm.world_size, comm.rank
        self.numel = sum(p.numel() for p in self.params)
        self.padded_numel = _padded(self.numel, world)
        self.shard_numel = self.padded_numel // world
        p0 = self.params[0]
        self.flat = torch.zeros(self.padded_numel, dtype=p0.dtype, device=p0.device)
        self.offsets = []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                self.flat[offset : offset + p.numel()].copy_(p.detach().view(-1))
                self.offsets.append(offset)
                offset += p.numel()
            broadcast(comm, self.flat, 0)
            for p, off in zip(self.params, self.offsets):
                p.data = self.flat[off : off + p.numel()].view_as(p)  # the model's weights: views of flat
        lo = rank * self.shard_numel
        self.shard = nn.Parameter(self.flat[lo : lo + self.shard_numel])  # shares flat's storage
        self.flat_grad = None
        if stage == 1:  # full gradient buffer, p.grad are views of it (autograd accumulates in place)
            self.flat_grad = torch.zeros_like(self.flat)
            self._attach_grad_views()
        self.inner = optimizer([self.shard], **kwargs)

    def _attach_grad_views(self) -> None:
        for p, off in zip(self.params, self.offsets):
            p.grad = self.flat_grad[off : off + p.numel()].view_as(p)

    def _flat_gradient(self) -> torch.Tensor:
        """The local full gradient as one padded flat vector (stage 1: the buffer itself)."""
        if self.stage == 1:
            for p, off in zip(self.params, self.offsets):
                view = self.flat_grad[off : off + p.numel()]
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():  # someone replaced p.grad (e.g. set_to_none)
                    view.copy_(p.grad.reshape(-1))
            self._attach_grad_views()
            return self.flat_grad
        pieces = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).view(-1) for p in self.params
        ]
        pad = self.padded_numel - self.numel
        if pad:
            pieces.append(self.flat.new_zeros(pad))
        for p in self.params:
            p.grad = None  # stage 2: the full gradients are freed once copied out
        return torch.cat(pieces)

    @torch.no_grad()
    def step(self) -> None:
        world, rank = self.comm.world_size, self.comm.rank
        flat_grad = self._flat_gradient()
        averaged = reduce_scatter(self.comm, flat_grad.view(world, -1), op="avg").view(-1)
        if self.stage == 1:  # keep the full buffer; its own slice now holds the average
            lo = rank * self.shard_numel
            flat_grad[lo : lo + self.shard_numel].copy_(averaged)
            self.shard.grad = flat_grad[lo : lo + self.shard_numel]
        else:
            self.shard.grad = averaged
        del flat_grad
        self.inner.step()
        gathered = allgather(self.comm, self.shard.detach())
        self.flat.copy_(gathered.view(-1))

    def zero_grad(self) -> None:
        if self.stage == 1:
            self.flat_grad.zero_()
            self._attach_grad_views()
        else:
            for p in self.params:
                p.grad = None
            self.shard.grad = None

    @property
    def state(self):
        """The inner optimizer's state: for this rank's shard only."""
        return self.inner.state

    @property
    def param_groups(self):
        """The inner optimizer's groups (set ``lr`` here, or hand ``opt`` to an LR scheduler's logic)."""
        return self.inner.param_groups

    def held_tensors(self) -> dict:
        """What this rank holds, by kind (for ``minidist.memory.tensor_bytes``)."""
        grads = [self.flat_grad, self.shard.grad] + [p.grad for p in self.params]  # views count once
        return {
            "params": [self.flat],
            "grads": [g for g in grads if g is not None],
            "optimizer": [dict(s) for s in self.inner.state.values()],
        }


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

    def gather(self) -> None:
        if self.gathered:
            return
        self.start_gather()
        rows = self.pending.wait()
        self.pending = None
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        self.full.data.copy_(rows.view(-1))  # through .data: no version bump for saved tensors
        self.owner._note_gathered(self)

    def free(self) -> None:
        if self.pending is not None:  # never leave a collective behind
            self.pending.wait()
            self.pending = None
        self.full.untyped_storage().resize_(0)

    def reduce_gradient(self) -> None:
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
    of (non-root) units whose full weights were materialised at the same time.
    """

    def __init__(
        self, module: nn.Module, comm: Communicator, units=None, prefetch: bool = True, shared=None
    ) -> None:
        super().__init__()
        object.__setattr__(self, "module", module)  # not a sub-module: parameters() are the shards
        self.comm, self.prefetch = comm, prefetch
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
