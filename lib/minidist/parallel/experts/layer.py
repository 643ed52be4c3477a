"""A mixture-of-experts layer in one process: the teaching path (a loop over the experts).

    x (T, d) ──► router ──► top-k experts, gates, capacity (``routing.route``)
      │
      ├──► expert 0:  rows of the tokens that chose it, kept ──► FFN_0 ──┐
      ├──► expert 1:  ...                                    ──► FFN_1 ──┤ y_t = Σ gate · FFN_e(x_t)
      └──► expert E-1 ...                                                ┘  (kept choices only)
      [+ shared experts: one dense FFN every token goes through, DeepSeekMoE's]

Each expert is an FFN like the course's dense MLP (``models.transformer.MLP``): Linear(d, f) ─
GELU ─ Linear(f, d) with biases; or SwiGLU, down(silu(gate(x)) * up(x)) without biases, the
experts of Mixtral and DeepSeek-V3. A token costs k experts' FLOPs however many experts there
are: parameters grow with E, compute with k.

Every rank of an expert-parallel run does what this layer does on its own tokens
(``ExpertParallelMoE``), so this layer applied to one rank's batch is the reference for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .routing import MoEStats, Routing, route

__all__ = ["ExpertFFN", "MoELayer"]

ACTIVATIONS = ("gelu", "swiglu")


class ExpertFFN(nn.Module):
    """One expert: ``down(gelu(up(x)))`` (the course's MLP) or ``down(silu(gate(x)) * up(x))`` (SwiGLU).

    Parameters: gelu 2·d·f + f + d (with biases); swiglu 3·d·f (Mixtral's and DeepSeek's: no biases).
    """

    def __init__(self, d_model: int, d_ffn: int, activation: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.up = nn.Linear(d_model, d_ffn, bias=bias)
        self.gate = nn.Linear(d_model, d_ffn, bias=bias) if activation == "swiglu" else None
        self.down = nn.Linear(d_ffn, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            return self.down(F.gelu(self.up(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoELayer(nn.Module):
    """Top-k mixture of experts over the last dimension: (..., d) -> (..., d).

    ``forward`` also leaves ``self.aux_loss`` (the load-balancing loss of this call, a scalar
    with the router's gradient; see ``routing``) and ``self.last_stats`` (a ``MoEStats``:
    per-expert load, kept and dropped counts, the capacity). ``capacity_factor=None``: no drops.
    """

    def __init__(
        self,
        d_model: int,
        d_ffn: int,
        num_experts: int,
        top_k: int = 2,
        capacity_factor: float | None = 1.25,
        *,
        activation: str = "gelu",
        bias: bool = True,
        num_shared_experts: int = 0,
        renormalize: bool | None = None,
    ) -> None:
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"need num_experts >= 1 and 1 <= top_k <= num_experts, got {num_experts}, {top_k}"
            )
        self.d_model, self.d_ffn, self.num_experts, self.top_k = d_model, d_ffn, num_experts, top_k
        self.capacity_factor, self.renormalize = capacity_factor, renormalize
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertFFN(d_model, d_ffn, activation, bias) for _ in range(num_experts))
        # shared experts (DeepSeekMoE): s experts every token uses, kept as one FFN s times as wide
        self.shared = (
            ExpertFFN(d_model, d_ffn * num_shared_experts, activation, bias) if num_shared_experts else None
        )
        self.aux_loss: torch.Tensor | None = None
        self.last_stats: MoEStats | None = None

    def route(self, x: torch.Tensor) -> Routing:
        """The router's decisions for the rows of ``x`` (T, d)."""
        return route(self.router(x), self.top_k, self.capacity_factor, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.d_model)
        routing = self.route(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero((routing.experts == e) & routing.kept, as_tuple=True)
            if token.numel():
                y = expert(flat[token]) * routing.gates[token, slot].unsqueeze(1)
                out = out.index_add(0, token, y)
        if self.shared is not None:
            out = out + self.shared(flat)
        self.aux_loss, self.last_stats = routing.aux_loss, routing.stats
        return out.view(x.shape)
