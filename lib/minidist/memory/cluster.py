"""What a layout runs on: a cluster (devices, memory, FLOP/s, two kinds of link) and a batch.

A cluster is nodes of devices. Devices in one node talk over the fast link (NVLink); devices in
different nodes over the slow one (InfiniBand, Ethernet). Each link is a ``LinkSpec`` of the
emulated transport -- latency alpha (seconds a message) and bandwidth (bytes a second, one
direction, per device) -- so the cost of a message is the same ``alpha + bytes / bandwidth``
that ``transport.emulated`` waits and ``collectives.cost_model`` counts::

    node 0: [gpu gpu gpu gpu gpu gpu gpu gpu]  <- intra: 450 GB/s each way (NVLink 4)
               |   |   |   |   |   |   |   |   <- inter: one 400 Gbit/s NIC per GPU
    node 1: [gpu gpu gpu gpu gpu gpu gpu gpu]

A group of ranks (a TP group, a DP group, ...) whose members all sit in one node uses ``intra``;
a group that spans nodes moves at the pace of its slowest hop, ``inter`` (``Cluster.link``).
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.transport.emulated import ETHERNET_10G, LinkSpec

__all__ = ["Batch", "Cluster", "LAPTOP_1G", "h100_cluster", "laptop_cluster"]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices of ``memory_bytes`` each, computing at
    ``peak_flops`` x ``mfu`` (the model FLOPs utilisation a good run sustains), joined by the
    ``intra``-node and ``inter``-node links."""

    name: str
    devices_per_node: int
    nodes: int
    memory_bytes: float
    peak_flops: float
    intra: LinkSpec
    inter: LinkSpec
    mfu: float = 0.4

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1:
            raise ValueError(
                f"need at least one node of one device, got {self.nodes} x {self.devices_per_node}"
            )
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu is a fraction of peak in (0, 1], got {self.mfu}")
        if min(self.memory_bytes, self.peak_flops, self.intra.bandwidth_Bps, self.inter.bandwidth_Bps) <= 0:
            raise ValueError(f"memory, FLOP/s and bandwidths must be positive: {self}")

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def flops_per_s(self) -> float:
        """What one device sustains: peak x mfu."""
        return self.peak_flops * self.mfu

    def link(self, span: int) -> LinkSpec:
        """The link of a group whose members lie within ``span`` consecutive ranks (ranks are
        numbered node by node): ``intra`` if that fits one node, else ``inter``."""
        return self.intra if span <= self.devices_per_node else self.inter


@dataclass(frozen=True)
class Batch:
    """One optimizer step's data: ``sequences`` sequences (the global batch) of ``seq`` tokens."""

    sequences: int
    seq: int

    def __post_init__(self) -> None:
        if self.sequences < 1 or self.seq < 1:
            raise ValueError(f"a batch needs sequences >= 1 and seq >= 1, got {self}")

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq


def h100_cluster(nodes: int = 1, mfu: float = 0.4) -> Cluster:
    """DGX H100 nodes: 8 H100 SXM5 each.

    Sources: NVIDIA H100 Tensor Core GPU datasheet -- 80 GB HBM3, 989 TFLOP/s dense BF16 (1,979
    "with sparsity", which training does not use), NVLink 900 GB/s per GPU (both directions
    together: 450 GB/s each way); NVIDIA DGX H100 datasheet -- 8 single-port ConnectX-7 400 Gbit/s
    InfiniBand NICs for the compute fabric, one per GPU: 50 GB/s each way per GPU. The latencies
    (3 us through NVSwitch, 10 us across InfiniBand) are our assumption of the order of NCCL's
    small-message times, not a datasheet figure; they matter only for small messages.
    """
    return Cluster(
        name=f"{nodes} x 8 H100 (NVLink 450 GB/s, IB 8 x 400 Gbit/s)",
        devices_per_node=8,
        nodes=nodes,
        memory_bytes=80e9,
        peak_flops=989e12,
        intra=LinkSpec(alpha_s=3e-6, bandwidth_Bps=450e9),
        inter=LinkSpec(alpha_s=10e-6, bandwidth_Bps=400e9 / 8),
        mfu=mfu,
    )


def laptop_cluster(devices: int = 4, gbit_per_s: float = 1.0) -> Cluster:
    """The course's laptop: ``devices`` processes on one machine joined by the emulated link.

    Every message pays ``ETHERNET_10G.alpha_s`` (15 us) + bytes / (``gbit_per_s`` x 1.25e8 B/s);
    the emulated link has one kind of hop, so intra = inter. Compute is the emulated clock's:
    100 GFLOP/s peak a device (the order of one laptop core with AVX2 FMA: 8 fp32 lanes x 2 FMA
    units x 2 FLOPs x 3 GHz = 96 GFLOP/s) at mfu 0.5; 4 GiB a device. These are the rates
    ``python -m minidist.bench layout`` gives its timed ranks, so its measurement and this model
    see the same machine.
    """
    link = LinkSpec(alpha_s=ETHERNET_10G.alpha_s, bandwidth_Bps=gbit_per_s * 1.25e8)
    return Cluster(
        name=f"laptop: {devices} ranks, emulated {gbit_per_s:g} Gbit/s",
        devices_per_node=devices,
        nodes=1,
        memory_bytes=4 * 2**30,
        peak_flops=100e9,
        intra=link,
        inter=link,
        mfu=0.5,
    )


#: 4 ranks on the emulated 1 Gbit/s link (the course's laptop)
LAPTOP_1G = laptop_cluster(4, 1.0)
