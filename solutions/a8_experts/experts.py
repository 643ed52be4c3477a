"""Assignment 8: a mixture of experts spread over the ranks -- all-to-all, capacity, expert parallel.

A mixture-of-experts layer (lecture 10 section 2; GShard, Lepikhin et al. 2020, section 2.2;
Switch Transformer, Fedus et al. 2021, section 2) replaces one feed-forward network by E of them
and lets a router send every token to k of them. With expert parallelism (lecture 10 section 3)
rank r holds experts [r E/p, (r+1) E/p) only: the tokens travel to their experts and back, in an
all-to-all each way. You write it from point-to-point messages up:

* ``all_to_all`` (task 1): the collective, equal and variable pieces, on ``comm.send/recv/isend/irecv``;
* ``route``, ``dispatch``, ``combine`` (task 2): top-k routing with capacity, on one process;
* ``all_to_all_differentiable`` and ``ExpertParallelMoE`` (tasks 3 and 4): the layer on p ranks,
  forward and backward equal to one process; task 4 measures the bytes it sends per token.

The rules, the same as lecture 10's:

- **Gates.** probs = softmax(logits) over the E experts; a token's k experts are its k largest
  probabilities, best first. k = 1: the gate is that probability (Switch); k > 1: the k
  probabilities divided by their sum (GShard, Mixtral).
- **Capacity.** An expert takes at most C = ceil(capacity_factor x T x k / E) of a rank's T tokens'
  choices (``capacity``; ``capacity_factor=None``: C = T, nothing is ever dropped). On p ranks
  every rank routes its own T tokens with this rule.
- **Priority.** Who is kept when an expert is over capacity -- deterministic, by position: the
  earlier token (row of ``logits``) comes first, and a token's choices in order:

      priority order:  (token 0, choice 0), (token 0, choice 1), (token 1, choice 0), ...

  Why by position and not GShard's "every first choice before any second choice": in a decoder a
  later token must not change an earlier one's output. By position, whether token t is kept
  depends on tokens 0..t only, so the layer stays causal whatever the capacity (GShard's order
  would let a later token's first choice push out an earlier token's second). An expert keeps
  its first C choices in that order and drops the rest. A dropped choice adds nothing to its
  token (the other gates are not renormalised).
- **What you may use.** ``comm.send``, ``recv``, ``isend``, ``irecv`` on the communicator you are
  given, ``torch.autograd.Function``, plain torch. Not the library's collectives
  (``minidist.collectives``, ``md.all_to_all``), its experts (``minidist.parallel.experts``), its
  context parallelism (``minidist.parallel.context``), nor ``torch.distributed``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minidist.comm import Communicator

__all__ = [
    "all_to_all",
    "capacity",
    "route",
    "dispatch",
    "combine",
    "all_to_all_differentiable",
    "ExpertParallelMoE",
]


# --- task 1: all-to-all ------------------------------------------------------------------------
def all_to_all(
    comm: Communicator, chunks: torch.Tensor | list[torch.Tensor], recv_sizes: list[int] | None = None
) -> torch.Tensor | list[torch.Tensor]:
    """Send piece j to rank j; piece i of the result came from rank i (lecture 10 section 1).

    Contract. Two forms; every rank calls the same one.

    * Equal pieces: ``chunks`` of shape (p, *chunk), the same on every rank. Returns a new tensor
      of that shape whose row i is row ``comm.rank`` of rank i's ``chunks``.
    * Variable pieces: ``chunks`` a list of p tensors, each with any first dimension, the same
      trailing shape and dtype on every rank. Returns a list of p new tensors, entry i the one rank
      i addressed to this rank. A receiver must know a piece's size before receiving it: unless
      ``recv_sizes`` gives them (entry i: the first dimension rank i sends here), the ranks first
      exchange their sizes, one int64 to every other rank.

    ``chunks`` is not modified. It must finish for any p and any piece size on every transport
    (on "pipe", a blocking ``send`` of a large message returns only once the receiver reads it).

    Cost, per rank: p - 1 messages of data; bytes sent = every piece but this rank's own (which
    is copied), so (p - 1) / p of the input for equal pieces, exactly; the sizes exchange adds
    p - 1 messages of 8 bytes (the grader counts what the transport carried). Not differentiable:
    task 3 needs its backward.

    Read: lecture 10 section 1 (pairwise exchange); MPI's MPI_Alltoall / MPI_Alltoallv.
    """
    # Questions before you write: in step s of a pairwise exchange, whom does rank r send to and
    # whom does it receive from, and is every receive matched by a send posted in the same step?
    # What happens on "pipe" if every rank sends all its pieces before it receives any? What must
    # a receiver know before its buffer can exist, and who can tell it?
    ### BEGIN SOLUTION TODO(task 1): all_to_all, equal and variable pieces
    p, rank = comm.world_size, comm.rank

    def exchange(sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> None:
        # pairwise: in step s, send to rank + s and receive from rank - s (mod p)
        recvs[rank].copy_(sends[rank])
        for step in range(1, p):
            dst, src = (rank + step) % p, (rank - step) % p
            work = comm.isend(sends[dst], dst)
            comm.recv(recvs[src], src)
            work.wait()

    if isinstance(chunks, torch.Tensor):
        if chunks.dim() == 0 or chunks.shape[0] != p:
            raise ValueError(f"equal pieces need a (world_size={p}, ...) tensor, got {tuple(chunks.shape)}")
        sends = list(chunks.detach().contiguous().unbind(0))
        recvs = [torch.empty_like(piece) for piece in sends]
        exchange(sends, recvs)
        return torch.stack(recvs)
    if len(chunks) != p:
        raise ValueError(f"variable pieces need a list of world_size={p} tensors, got {len(chunks)}")
    sends = [piece.detach().contiguous() for piece in chunks]
    if recv_sizes is None:
        counts = [torch.tensor([piece.shape[0]], dtype=torch.int64) for piece in sends]
        heard = [torch.empty(1, dtype=torch.int64) for _ in range(p)]
        exchange(counts, heard)
        recv_sizes = [int(n) for n in torch.cat(heard)]
    like = sends[rank]
    recvs = [like.new_empty((n, *like.shape[1:])) for n in recv_sizes]
    exchange(sends, recvs)
    return recvs
    ### END SOLUTION


# --- task 2: routing with capacity, dispatch and combine on one process ------------------------
def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int:
    """C = ceil(capacity_factor x tokens x top_k / num_experts); ``tokens`` when the factor is None."""
    if capacity_factor is None:
        return tokens
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def route(
    logits: torch.Tensor, top_k: int, capacity_factor: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's decisions for T tokens: (experts, gates, slots), each (T, top_k).

    Contract. ``logits`` (T, E). ``experts[t, j]``: token t's j-th choice (best first, int64);
    ``gates[t, j]``: its gate (the module docstring's rule; differentiable with respect to
    ``logits``); ``slots[t, j]``: the position of that choice in its expert's queue -- 0 for the
    first choice the expert keeps, up to C - 1 -- or -1 when the expert dropped it (C =
    ``capacity(T, top_k, E, capacity_factor)``, the module docstring's priority).

    Cost: O(T k E) work and memory; no Python loop over tokens.

    Read: Switch section 2.2 and GShard section 2.2 (expert capacity; GShard's order of the
    choices is not ours, the module docstring says why).
    """
    # Questions before you write: how does a running count over the choices, taken in priority
    # order, give each choice its place in its expert's queue? Which order is "priority order"
    # for a (T, k) tensor, and how do you flatten it that way?
    ### BEGIN SOLUTION TODO(task 2): top-k, gates, every choice's slot or -1
    tokens, num_experts = logits.shape
    probs = torch.softmax(logits, dim=-1)
    top, experts = probs.topk(top_k, dim=-1)
    gates = top / top.sum(dim=-1, keepdim=True) if top_k > 1 else top
    limit = capacity(tokens, top_k, num_experts, capacity_factor)
    chosen = nn.functional.one_hot(experts.reshape(-1), num_experts)  # (T k, E), priority order
    queue = (chosen.cumsum(0) * chosen).sum(1) - 1
    slots = torch.where(queue < limit, queue, -1).view(tokens, top_k)
    return experts, gates, slots
    ### END SOLUTION


def dispatch(
    x: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """The experts' input buffer (E, C, d): ``buffer[e, c]`` is the row of x whose kept choice of
    expert e sits in slot c; zeros where no choice sits. Differentiable with respect to ``x``.

    Cost: E C d elements, whatever the routing (GShard's fixed layout).
    """
    ### BEGIN SOLUTION TODO(task 2): dispatch into (E, C, d)
    token, choice = torch.nonzero(slots >= 0, as_tuple=True)
    place = experts[token, choice] * capacity + slots[token, choice]
    flat = x.new_zeros(num_experts * capacity, x.shape[1]).index_add(0, place, x[token])
    return flat.view(num_experts, capacity, x.shape[1])
    ### END SOLUTION


def combine(
    expert_out: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    """The layer's output (T, d): token t gets the sum over its kept choices j of
    ``gates[t, j] * expert_out[experts[t, j], slots[t, j]]``; a token with none kept gets zeros.
    Differentiable with respect to ``expert_out`` and ``gates``.
    """
    ### BEGIN SOLUTION TODO(task 2): combine (T, d)
    token, choice = torch.nonzero(slots >= 0, as_tuple=True)
    rows = expert_out[experts[token, choice], slots[token, choice]] * gates[token, choice].unsqueeze(1)
    return expert_out.new_zeros(slots.shape[0], expert_out.shape[2]).index_add(0, token, rows)
    ### END SOLUTION


# --- tasks 3 and 4: expert parallel ------------------------------------------------------------
def all_to_all_differentiable(
    comm: Communicator, pieces: list[torch.Tensor], recv_sizes: list[int] | None = None
) -> list[torch.Tensor]:
    """``all_to_all``'s variable form, with a backward: the gradient of entry i of the result
    reaches rank i's ``pieces[rank]``.

    Contract. As ``all_to_all(comm, pieces, recv_sizes)`` in forward; ``loss.backward()`` on
    every rank gives every piece that requires grad the gradient that flowed into the rows it
    became on the receiving rank. Every rank must run the backward exchanges in the same order.

    Cost: forward as ``all_to_all``; backward the same bytes again, without the sizes exchange.

    Read: lecture 10 section 3 (the backward of dispatch is a combine); torch.autograd.Function.
    """
    # Questions before you write: what is the backward of a transpose of pieces? Which sizes
    # does the backward's exchange already know?
    ### BEGIN SOLUTION TODO(task 3): an all_to_all autograd can differentiate

    class AllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            ctx.sizes = [piece.shape[0] for piece in inputs]
            return tuple(all_to_all(comm, list(inputs), recv_sizes))

        @staticmethod
        def backward(ctx, *grads):
            return tuple(all_to_all(comm, [g.contiguous() for g in grads], ctx.sizes))

    return list(AllToAll.apply(*pieces))
    ### END SOLUTION


class ExpertParallelMoE(nn.Module):
    """A top-k mixture of E experts over p ranks; this rank holds experts [r E/p, (r+1) E/p).

    Contract. Every rank builds the same ``router`` (an ``nn.Linear(d, E, bias=False)``) and
    passes its own E/p ``experts`` (modules (n, d) -> (n, d), in order); p divides E and every
    rank has the same number T of tokens. ``layer(x)`` (x: (T, d), this rank's tokens) returns
    what one process computes for these T tokens with all E experts: ``route`` on
    ``router(x)`` with capacity from T, every kept choice through its expert wherever it lives,
    combined with its gate. After every rank's ``loss.backward()`` (each rank its own loss), the
    gradients equal one process's on the sum of the ranks' losses: ``x.grad`` its tokens', the
    router's this rank's tokens' only (a replica's, as in data parallelism before averaging),
    a local expert's the sum over every rank's tokens that reached it. Use the ``router`` and
    ``experts`` you are given (the grader reads their gradients) and your ``all_to_all`` for
    every exchange. Expert parallelism moves the tokens to the experts: in the forward, each
    token's row (its d float64s, as they are) must reach every other rank that holds one of its
    kept choices -- the grader reads what your communicator sent, and a layer that computes the
    output some other way fails.

    Cost, measured in task 4: the bytes the transport carries from every rank from building the
    layer to the end of one forward and backward, over the tokens, in rows of d float64s. What
    travels is up to you; three layouts,
    counted from the routing over the four exchanges (dispatch, combine, and their backward):

        GShard's (E, C, d) buffer, padding included           4 (p-1)/p x E x C / T
        a row per kept choice whose expert is elsewhere       4 x (kept choices on other ranks) / T
        a token once to each other rank holding any of its
        kept choices                                          4 x (token, other rank) pairs / T

    (the README gives the tiers; lecture 10's assignment paragraph, at its end, the layouts).

    Read: GShard section 2.2-2.3 and Switch section 2.2 (dispatch, combine, capacity), lecture
    10 sections 2-3.
    """

    # Questions before you write. What is the backward of an all-to-all, and which sizes does it
    # already know? In which order do the ranks' backward exchanges run, and is it the same on
    # every rank -- also on a rank whose experts no token chose? What does a rank need to know
    # about a row it receives to send the right answer back, and can that travel in the same
    # message? For task 4: which rows does your layout send that no expert needs, and how many
    # times does one token's row travel to one rank? Where can a weighted sum be formed?
    def __init__(
        self,
        router: nn.Linear,
        experts: list[nn.Module],
        comm: Communicator,
        num_experts: int,
        top_k: int,
        capacity_factor: float | None,
    ) -> None:
        super().__init__()
        ### BEGIN SOLUTION TODO(task 3): keep what forward needs
        if num_experts % comm.world_size or len(experts) != num_experts // comm.world_size:
            raise ValueError(f"each of {comm.world_size} ranks holds E/p of E={num_experts} experts")
        self.router, self.experts, self.comm = router, nn.ModuleList(experts), comm
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION TODO(task 3): route, send, compute, send back, combine
        p, local = self.comm.world_size, len(self.experts)
        experts, gates, slots = route(self.router(x), self.top_k, self.capacity_factor)
        kept = slots >= 0
        owner = experts // local
        # each token once to each rank that holds any of its kept experts, with the gates it
        # needs there as `local` more columns (0 for an expert it did not choose or lost)
        tokens, outgoing = [], []
        for q in range(p):
            mine = kept & (owner == q)
            token = torch.nonzero(mine.any(1)).squeeze(1)
            weight = torch.where(mine, gates, torch.zeros_like(gates))[token]  # (n, k)
            column = torch.where(mine, experts - q * local, torch.zeros_like(experts))[token]
            weights = x.new_zeros(token.numel(), local).scatter_add(1, column, weight)
            tokens.append(token)
            outgoing.append(torch.cat([x[token], weights], dim=1))
        sent = [t.numel() for t in tokens]
        incoming = all_to_all_differentiable(self.comm, outgoing)
        partial = []
        for rows in incoming:
            inputs, weights = rows[:, : x.shape[1]], rows[:, x.shape[1] :]
            out = inputs * 0  # not new_zeros: with no rows here, the backward must still reach the exchange
            for e, expert in enumerate(self.experts):
                use = torch.nonzero(weights[:, e].detach() != 0).squeeze(1)
                if use.numel():
                    out = out.index_add(0, use, expert(inputs[use]) * weights[use, e : e + 1])
            partial.append(out)
        back = all_to_all_differentiable(self.comm, partial, sent)
        y = x.new_zeros(x.shape)
        for token, rows in zip(tokens, back):
            y = y.index_add(0, token, rows)
        return y
        ### END SOLUTION
