"""Assignment 7: ZeRO from the communicator's collectives up -- shard what every rank holds.

Data parallelism keeps N copies of everything: fp32 AdamW holds 4 bytes of weight, 4 of
gradient and 8 of optimizer state per parameter on every rank. ZeRO (Rajbhandari et al. 2020,
sections 5.1-5.3; lecture 8 sections 1-2) cuts a *flat* vector of the parameters into N equal
shards and makes rank r responsible for shard r only. You write two of its stages here:

* ``ShardedAdamW`` (task 1, ZeRO-2): the optimizer state and the averaged gradient live in this
  rank's shard only; the weights stay whole.
* ``ShardedStack`` (tasks 2 and 3, ZeRO-3): a stack of layers whose weights live in shards too,
  each unit (one layer of the stack) gathered just before it computes and freed after.

The layout both share (the grader reads your shards with it):

    flat      the parameters in ``parameters()`` order, each flattened, concatenated
    padded    flat followed by zeros up to the next multiple of N (numel not divisible by N)
    shard r   elements [r * S, (r + 1) * S) of padded, S = padded numel / N

You may use ``md.reduce_scatter``, ``md.allgather`` (synchronous or ``async_op=True``) and
``md.broadcast`` on the communicator you are given, ``torch.optim.AdamW`` on tensors you own,
``torch.utils.checkpoint`` and plain torch. Not the library's ZeRO (``minidist.parallel.zero``),
nor torch's FSDP, ``ZeroRedundancyOptimizer`` or ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

import minidist as md  # noqa: F401 -- the student code you write calls md.reduce_scatter and md.allgather
from minidist.comm import Communicator

__all__ = ["ShardedAdamW", "ShardedStack"]


# --- task 1: ZeRO-2 ----------------------------------------------------------------------------
class ShardedAdamW:
    """AdamW whose state and averaged gradient are sharded over the ranks (ZeRO stage 2).

    Contract. Every rank builds the same model (same shapes, same values) and calls, each step,
    ``loss.backward()`` on its own batch, then ``opt.step()``, then ``opt.zero_grad()``. After
    ``step()`` every rank's parameters equal those of one process running
    ``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` on the gradient *averaged* over
    the ranks -- whatever the parameters' sizes, padding included.

    Cost, per rank and step (Psi = the padded parameter count, in elements):

    * communication: exactly one ``md.reduce_scatter`` and one ``md.allgather``, together
      2 Psi (N - 1) / N elements sent -- what DDP's one allreduce costs (lecture 8 section 2);
      nothing else on the communicator (the grader counts the transport's bytes). The
      reduce-scatter carries this rank's gradient (the parameters' gradients in their order,
      flattened, zeros to pad; divided by N if you sum), the allgather this rank's shard of the
      updated parameters: the grader compares both with what your rank holds;
    * memory: AdamW's two moments for the S = Psi / N elements of this rank's shard only; the
      full gradients do not outlive ``step()`` (every ``p.grad`` is None after it).

    Read: ZeRO section 5.1-5.2 (P_os, P_os+g), lecture 8 section 2 ("The three stages").
    """

    # Questions before you write: which flat positions does rank r own, and which zeros must
    # every rank add so that N shards of equal size exist? What does reduce_scatter expect as its
    # input's shape? What must AdamW see as "its" parameter so that its state has S elements?
    # How do the new weights get back into the model's own tensors?
    def __init__(
        self,
        params: Iterable[nn.Parameter],
        comm: Communicator,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        raise NotImplementedError(
            "TODO(task 1): the layout of the shards and an AdamW over this rank's shard"
        )

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients into this rank's shard, step AdamW on it, give every rank the new weights."""
        raise NotImplementedError("TODO(task 1): one reduce-scatter, AdamW on the shard, one allgather")

    def zero_grad(self) -> None:
        """Forget every gradient (the model's and the shard's)."""
        raise NotImplementedError("TODO(task 1): zero_grad")


# --- tasks 2 and 3: ZeRO-3 ---------------------------------------------------------------------
class ShardedStack(nn.Module):
    """``layers[-1](...(layers[1](layers[0](x))))`` with every layer's weights sharded (ZeRO-3).

    Contract. ``layers`` is the same list of modules on every rank (same shapes and values);
    each layer is a *unit*. ``parameters()`` yields one shard per unit, in layer order: unit i's
    shard is this rank's S_i elements of ``layers[i].parameters()`` flattened, concatenated and
    padded (the module docstring's layout). ``stack(x)`` returns what the dense stack returns;
    after ``loss.backward()`` each shard's ``.grad`` holds its part of the gradient averaged over
    the ranks, so that ``torch.optim.AdamW(stack.parameters())`` trains the stack exactly as one
    process would on the whole batch. Between forward and backward, and after backward, no layer
    holds its full weights.

    Cost, per rank and step: one allgather per unit in forward, one per unit in backward, one
    reduce-scatter per unit in backward -- 3 Psi (N - 1) / N elements sent, nothing else. At
    any moment at most two units hold their full weights: the one computing and, with
    ``prefetch``, the next one, whose allgather (``async_op=True``) is in flight while the
    current one computes (the grader counts the units that hold weights at every layer's
    forward and backward).

    Measured (task 3): the peak of the bytes torch allocates on this rank during two training
    steps, over what ZeRO-3's model states need (16 bytes x Psi / N). Everything you allocate
    counts: shards, AdamW's moments, gathered weights, gradients, the activations kept for
    backward, temporaries. The library's ``FullyShardedModule`` reaches the second tier (1.81x;
    full points at 1.60x).

    Read: ZeRO section 5.3 (P_os+g+p) and 7 (activation memory), lecture 8 sections 2.1 and 3.
    """

    # Questions before you write. Which tensors does autograd keep for backward, and do they
    # still hold weights you meant to free? Who gathers a unit again before its backward, and
    # how does your code know that moment has come? When can the next unit's allgather start so
    # that it overlaps this unit's compute, and when must you wait for it? Where does a unit's
    # gradient go once it is reduce-scattered, and what of it must not outlive that? For task 3:
    # which of the bytes above does a dense stack need that ZeRO-3 does not, and which does your
    # own design keep alive longer than it must (lecture 8 section 3)?
    def __init__(self, layers: list[nn.Module], comm: Communicator, prefetch: bool = True) -> None:
        super().__init__()
        raise NotImplementedError("TODO(task 2): cut every unit into its shard; keep no full weights")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("TODO(task 2): the units in order, each gathered just in time")
