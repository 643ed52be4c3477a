"""Choosing a layout: every DP x TP x PP x CP x EP x ZeRO split of a cluster, priced and ranked.

    plans = enumerate_layouts(decoder.CONFIGS["gpt3-175b"], h100_cluster(nodes=128), Batch(1536, 2048))
    best = next(p for p in plans if p.fits)      # ranked: layouts that fit first, then by step time
    best.layout, best.step_s, best.parts, best.memory["total"]

For each layout ``predict`` says the bytes a device holds (``memory.estimate``, a MoE's
experts included) and the seconds of a step (``step_time``: compute from FLOPs, every message by
alpha-beta). Ranks are numbered with TP innermost, then CP, DP (EP inside DP), PP outermost, so
a group's span -- and with it its link, ``Cluster.link`` -- is:

    TP  t          CP  t c          DP (and EP)  t c d          PP  the whole layout

Two thresholds the students meet, from the same formulas:

* ``dp_critical_tokens``: data parallelism hides its allreduce behind backward while each
  device's batch exceeds C/W tokens (Austin et al., "How to Scale Your Model", part 5, "Data
  Parallelism": B/X > C/W_ici; 2,550 for TPU v5p, C = 4.6e14 and W = 2 x 9e10);
* ``tp_collapse_factor``: TP across nodes pays the bandwidth ratio of the links (NVLink over
  InfiniBand: 450/50 = 9, times (15/16)/(7/8) for 16 ranks against 8).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from minidist.memory import step_time as st
from minidist.memory.cluster import Batch, Cluster
from minidist.memory.context_parallel import activation_bytes_per_layer_cp
from minidist.memory.per_rank import estimate
from minidist.models import counting, transformer
from minidist.models.transformer import TransformerConfig

__all__ = [
    "Layout",
    "Prediction",
    "dp_critical_tokens",
    "enumerate_layouts",
    "padded_vocabulary",
    "predict",
    "stage_flops_per_token",
    "tp_collapse_factor",
]


@dataclass(frozen=True)
class Layout:
    """dp x tp x pp x cp devices; ep divides dp (experts split over part of the data-parallel
    group, as in DeepSpeed-MoE and Megatron-Core); ``microbatch`` sequences a pipeline microbatch."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    microbatch: int = 1

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def __str__(self) -> str:
        parts = [f"{k.upper()}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp),
                                                ("cp", self.cp), ("ep", self.ep)) if v > 1]  # fmt: skip
        name = "x".join(parts) or "1 device"
        return name + (f" ZeRO-{self.zero}" if self.zero else "")


@dataclass(frozen=True)
class Prediction:
    """A layout priced: bytes a device holds, whether it fits, seconds a step and their parts
    (compute, bubble, tp, cp, ep, pp_p2p, dp: they add up to ``step_s``)."""

    layout: Layout
    memory: dict[str, int]
    fits: bool
    step_s: float
    parts: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0


def stage_flops_per_token(
    cfg: TransformerConfig, seq: int, pp: int = 1, stage: int = 0, blocks_only: bool = False
) -> float:
    """Training FLOPs per token of pipeline stage ``stage`` (forward + backward: 6 per active weight):

        layers  sum over the stage's blocks of 6 x active parameters + 12 s d   (attention scores)
        last    + 6 V d   (the output layer: the word table as a matmul)
        first   + 6 x the rest (positions, segments, norms outside the blocks)

    Active parameters are ``models.counting``'s (a MoE block: router, top_k routed and the shared
    experts). Summed over the stages this is ``memory.flops_per_token(cfg, seq)``.
    ``blocks_only``: the blocks' share alone."""
    d, layers = cfg.hidden_size, cfg.n_layers
    total = (
        transformer.parameter_count(cfg) if cfg.classic else counting.transformer_parameter_count(cfg, True)
    )
    blocks = [counting.block_parameter_count(cfg, layer, active=True) for layer in range(layers)]
    mine = range(stage * layers // pp, (stage + 1) * layers // pp)
    flops = sum(6 * blocks[layer] + 12 * seq * d for layer in mine)
    if blocks_only:
        return float(flops)
    if stage == pp - 1:
        flops += 6 * cfg.vocab_size * d
    if stage == 0:
        flops += 6 * (total - sum(blocks) - cfg.vocab_size * d)
    return float(flops)


def _embedding_params(cfg: TransformerConfig, tp: int) -> int:
    """Parameters of the embedding on one rank: the word table's 1/tp, positions, segments, norm."""
    d = cfg.hidden_size
    rest = cfg.type_vocab_size * d + (cfg.max_positions * d if cfg.position == "learned" else 0)
    return (
        cfg.vocab_size * d // tp
        + rest
        + (counting.norm_parameter_count(cfg) if cfg.embedding_layernorm else 0)
    )


def _stage_memory(
    cfg, batch: Batch, layout: Layout, stage: int, precision: str, recompute: str
) -> dict[str, int]:
    """``estimate`` for one stage (ZeRO over dp x cp, experts over dp x cp / ep); with cp > 1 a
    classic block's activations are ``activation_bytes_per_layer_cp``'s (ring attention at
    S/cp tokens, no s^2 scores)."""
    micro = layout.microbatch if layout.pp > 1 else batch.sequences // layout.dp
    mem = estimate(cfg, batch=micro, seq=batch.seq // layout.cp, zero_stage=layout.zero,
                   dp=layout.dp * layout.cp, tp=layout.tp, pp=layout.pp, stage=stage, ep=layout.ep,
                   precision=precision, recompute=recompute)  # fmt: skip
    if layout.cp > 1 and cfg.classic:
        per_layer = activation_bytes_per_layer_cp(batch.seq, micro, cfg.hidden_size, cfg.n_heads,
                                                  cp=layout.cp, tp=layout.tp)  # fmt: skip
        acts = round(per_layer * (cfg.n_layers // layout.pp) * (layout.pp - stage))
        mem["total"] += acts - mem["activations"]
        mem["activations"] = acts
    return mem


def predict(
    cfg: TransformerConfig,
    cluster: Cluster,
    batch: Batch,
    layout: Layout,
    *,
    precision: str = "mixed",
    dp_overlap: float = 1.0,
    recompute: str = "none",
) -> Prediction:
    """Memory per device and seconds per step of ``layout`` (see the module and ``step_time``).

    ``precision`` "mixed" (16-bit activations and gradients, 16 bytes a parameter of states)
    or "fp32" (our CPU runs). ``dp_overlap`` is the fraction of the blocks' backward the gradient
    synchronisation can hide behind when pp = 1 (DDP's buckets) -- all but the embedding's, whose
    gradient is complete only when backward ends; with a pipeline it runs after the flush (our
    executor, and Megatron's default), hidden behind nothing. A MoE config (``cfg.num_experts``)
    splits its experts over ``layout.ep``; like ``estimate``, it takes tp = 1."""
    cfg = padded_vocabulary(cfg, layout.tp)
    e = 2 if precision == "mixed" else 4
    dp, tp, pp, cp, ep = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep
    m = batch.sequences // dp // layout.microbatch if pp > 1 else 1
    micro = layout.microbatch if pp > 1 else batch.sequences // dp
    tokens = micro * batch.seq / cp  # one device's tokens in one microbatch
    rate, d, kv = cluster.flops_per_s, cfg.hidden_size, cfg.kv_heads * cfg.head_dim
    layers = cfg.n_layers // pp
    link_tp, link_cp, link_dp = cluster.link(tp), cluster.link(tp * cp), cluster.link(tp * cp * dp)
    link_ep, link_pp = cluster.link(tp * cp * ep), cluster.link(layout.devices)
    stages, memories = [], []
    for stage in range(pp):
        mem = _stage_memory(cfg, batch, layout, stage, precision, recompute)
        memories.append(mem)
        compute = st.compute_s(stage_flops_per_token(cfg, batch.seq, pp, stage) * tokens / tp, rate)
        tp_s = st.tensor_parallel_s(tokens, d, layers, tp, e, link_tp)
        attention = st.compute_s(layers * 12 * batch.seq * d * tokens / tp, rate)
        cp_s = st.exposed_s(st.context_parallel_s(tokens, kv, layers, cp, tp, e, link_cp), attention)
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(stage * layers, (stage + 1) * layers))
        ep_s = st.expert_parallel_s(tokens, d, moe_layers, ep, cfg.top_k, e, link_ep)
        # the embedding's gradient is complete only when backward ends (its lookup is the first
        # layer; tied, it also waits for the output layer's share): its sync hides behind nothing
        experts = mem.get("expert_params_count", 0)
        last = _embedding_params(cfg, tp) if stage == 0 and pp == 1 else 0
        dense = (mem["params_count"] - experts - last) * e
        dp_s = st.data_parallel_s(dense, dp * cp, link_dp, layout.zero)
        dp_s += st.data_parallel_s(experts * e, dp * cp // ep, link_dp, layout.zero)
        # what DP can hide behind: the blocks' backward (forward too for ZeRO-3's gathers). Not
        # the output layer's: it runs first, and its gradient (tied: the word table's) is not ready
        blocks = st.compute_s(stage_flops_per_token(cfg, batch.seq, pp, stage, True) * tokens / tp, rate)
        hide = 0.0 if pp > 1 else dp_overlap * blocks * (1.0 if layout.zero == 3 else 2 / 3)
        dp_s = st.exposed_s(dp_s, hide) + st.data_parallel_s(last * e, dp * cp, link_dp, layout.zero)
        stages.append(dict(compute=compute, tp=tp_s, cp=cp_s, ep=ep_s, dp=dp_s))
    slots = [s["compute"] + s["tp"] + s["cp"] + s["ep"] for s in stages]
    path = st.pipeline_s(slots, m)
    slowest = stages[max(range(pp), key=lambda s: slots[s])]
    parts = {k: m * slowest[k] for k in ("compute", "tp", "cp", "ep")}
    parts["bubble"] = path - m * max(slots)
    parts["pp_p2p"] = st.pipeline_p2p_s(tokens, d, pp, e, link_pp)
    parts["dp"] = max(s["dp"] for s in stages)
    step = sum(parts.values())
    memory = max(memories, key=lambda mem: mem["total"])  # the fullest stage
    fits = memory["total"] <= cluster.memory_bytes
    return Prediction(layout, memory, fits, step, parts, batch.tokens / step)


def padded_vocabulary(cfg: TransformerConfig, tp: int) -> TransformerConfig:
    """``cfg`` with its vocabulary rounded up to a multiple of tp (what Megatron does before it
    splits the word table: GPT-3's 50,257 words become 50,264 for tp = 8)."""
    vocab = -(-cfg.vocab_size // tp) * tp
    return cfg if vocab == cfg.vocab_size else dataclasses.replace(cfg, vocab_size=vocab)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_layouts(
    cfg: TransformerConfig,
    cluster: Cluster,
    batch: Batch,
    *,
    precision: str = "mixed",
    zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    microbatch: int = 1,
    dp_overlap: float = 1.0,
    recompute: str = "none",
) -> list[Prediction]:
    """Every layout with dp x tp x pp x cp = ``cluster.devices``, priced by ``predict``, ranked:
    those that fit in memory first, each group by predicted step time.

    Kept: tp divides the heads and the MLP width (the vocabulary is padded: ``padded_vocabulary``),
    and is 1 for MoE and newer-block configs (``estimate`` models them without TP);
    pp divides the layers; cp divides the sequence; dp divides the global batch (with pp > 1,
    dp x microbatch divides it); ep > 1 only for a MoE, dividing dp and the experts;
    ZeRO > 0 only with a data-parallel group (dp x cp > 1)."""
    n = cluster.devices
    plans = []
    for tp, pp, cp in itertools.product(_divisors(n), repeat=3):
        if n % (tp * pp * cp):
            continue
        dp = n // (tp * pp * cp)
        if cfg.n_heads % tp or cfg.ffn_size % tp or cfg.n_layers % pp or (tp > 1 and not cfg.classic):
            continue
        if batch.seq % cp or batch.sequences % (dp * (microbatch if pp > 1 else 1)):
            continue
        eps = [ep for ep in _divisors(dp) if cfg.num_experts % ep == 0] if cfg.num_experts else [1]
        for ep, zero in itertools.product(eps, zero_stages):
            if zero and dp * cp == 1:
                continue
            layout = Layout(dp, tp, pp, cp, ep, zero, microbatch)
            plans.append(predict(cfg, cluster, batch, layout, precision=precision,
                                 dp_overlap=dp_overlap, recompute=recompute))  # fmt: skip
    return sorted(plans, key=lambda p: (not p.fits, p.step_s))


def dp_critical_tokens(
    cluster: Cluster | None = None,
    *,
    flops_per_s: float | None = None,
    bandwidth_Bps: float | None = None,
    grad_bytes: int = 2,
    ranks: int | None = None,
) -> float:
    """Tokens per device above which data parallelism's allreduce hides behind backward.

    Backward costs 4 N b / C (b tokens on the device, C FLOP/s); the ring allreduce of the
    gradients 2 (q-1)/q x g N / W (alpha left out). Equal at

        b* = (q-1)/q x g/2 x C / W       -> C / W for 16-bit gradients and many ranks

    Austin et al., "How to Scale Your Model" (2025), part 5, "Data Parallelism": compute-bound
    while B/X > C/W_ici; for TPU v5p (C = 4.6e14, W = 2 x 9e10 over a bidirectional ICI ring)
    "at least 2,550". ``cluster`` gives C = peak x mfu and W = the link of ``ranks`` ranks
    (default: all of them; one node's NVLink, or the NICs across nodes); or pass them. ``ranks``
    None means many (the factor (q-1)/q -> 1): 879 tokens on 8 H100s' NVLink, 7,912 across nodes."""
    c = flops_per_s if flops_per_s is not None else cluster.flops_per_s
    w = bandwidth_Bps if bandwidth_Bps is not None else cluster.link(ranks or cluster.devices).bandwidth_Bps
    ring = 1.0 if ranks is None else (ranks - 1) / ranks
    return ring * grad_bytes / 2 * c / w


def tp_collapse_factor(cluster: Cluster, inside: int | None = None, across: int | None = None) -> float:
    """How much longer TP's allreduces take on ``across`` ranks spanning nodes than on ``inside``
    ranks within one node, for the same tokens (alpha left out; ``tensor_parallel_s``):

        [(T-1)/T / W_inter] / [(t-1)/t / W_intra]

    8 H100s on NVLink (450 GB/s) against 16 on two nodes' 400 Gbit/s NICs (50 GB/s):
    9 x (15/16)/(7/8) = 9.64. The reason every recipe keeps TP inside a node (Narayanan et al.
    2021, sec. 3.3: "tensor model parallelism within a server")."""
    t = inside or cluster.devices_per_node
    big = across or 2 * t
    return ((big - 1) / big / cluster.inter.bandwidth_Bps) / ((t - 1) / t / cluster.intra.bandwidth_Bps)
