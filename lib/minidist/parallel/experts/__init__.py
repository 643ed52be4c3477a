"""Mixture of experts and expert parallelism (``from minidist.parallel import experts``).

A mixture-of-experts layer replaces a transformer block's one MLP by E MLPs ("experts") and a
router that sends each token to k of them: parameters grow with E, FLOPs per token with k.

    moe = experts.MoELayer(d_model, d_ffn, num_experts, top_k=2, capacity_factor=1.25)  # one process
    y = moe(x); moe.aux_loss; moe.last_stats       # output, load-balancing loss, per-expert counts
    ep = experts.ExpertParallelMoE(moe, comm)       # rank r holds experts [r E/p, (r+1) E/p)
    experts.distribute_experts(model, comm)          # every MoELayer of a model, in place

Modules, in reading order:

    routing          softmax top-k router, capacity C = ceil(cf·T·k/E), who is dropped, the
                     load-balancing loss, ``MoEStats``
    layer            ``ExpertFFN`` (GELU or SwiGLU), ``MoELayer``: the loop over experts
    expert_parallel  ``ExpertParallelMoE``: dispatch and combine with two all_to_alls, autograd
                     through both
    traffic          bytes per token of EP against TP-sharded experts (formulas), and
                     ``TensorParallelExperts`` to measure the TP side
"""

from .expert_parallel import ExpertParallelMoE, distribute_experts
from .layer import ExpertFFN, MoELayer
from .routing import MoEStats, Routing, capacity, route
from .traffic import TensorParallelExperts, bytes_per_token, ep_bytes, off_rank_assignments, tp_bytes

__all__ = [
    "ExpertFFN",
    "ExpertParallelMoE",
    "MoELayer",
    "MoEStats",
    "Routing",
    "TensorParallelExperts",
    "bytes_per_token",
    "capacity",
    "distribute_experts",
    "ep_bytes",
    "off_rank_assignments",
    "route",
    "tp_bytes",
]
