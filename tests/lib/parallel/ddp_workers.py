"""Worker functions and a tiny model for tests/lib/parallel/test_ddp.py (importable by md.launch workers).

Every run is described by a plain dict (``config``) so the single-process reference
and the ranks build exactly the same model and data:

    world_size, batch (per rank), steps, micro (micro-steps accumulated per step),
    bucket_mb, tie, unused, frozen, sometimes_used, find_unused, overlap, seed
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

import minidist as md
from minidist.parallel.buckets import allreduce_average

VOCAB, DIM, SEQ = 13, 8, 5
SEVERAL_BUCKETS_MB = 0.0003  # 314 bytes: TinyNet's gradients fall into 2 buckets


def config(**overrides) -> dict:
    base = dict(
        world_size=2,
        batch=3,
        steps=3,
        micro=1,
        bucket_mb=1.0,
        tie=False,
        unused=False,
        frozen=False,
        sometimes_used=False,
        find_unused=False,
        overlap=True,
        seed=1234,
        lr=0.01,
    )
    base.update(overrides)
    return base


class TinyNet(nn.Module):
    """Embedding -> tanh(Linear) [-> + frozen Linear] -> Linear head; options for the DDP corner cases.

    tie: the head's weight IS the embedding table (one Parameter, two names).
    unused: a Linear that forward never calls. frozen: a Linear with requires_grad=False.
    sometimes_used: a Linear applied only to samples with an even target, so a rank
    whose slice has none does not use it in that step.
    A buffer ``scale`` (rank-specific at init) checks that buffers are broadcast too.
    """

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False) if cfg["frozen"] else None
        self.extra = nn.Linear(DIM, 2) if cfg["sometimes_used"] else None
        self.head = nn.Linear(DIM, VOCAB)
        if cfg["tie"]:
            self.head.weight = self.embed.weight
        self.unused = nn.Linear(DIM, 3) if cfg["unused"] else None
        self.register_buffer("scale", 1.0 + 0.1 * torch.rand(DIM))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).mean(dim=1) * self.scale
        h = torch.tanh(self.hidden(h))
        if self.frozen is not None:
            h = h + self.frozen(h)
        loss = F.cross_entropy(self.head(h), targets)  # mean over this batch
        if self.extra is not None:
            even = (targets % 2 == 0).nonzero().flatten()
            if even.numel():  # a sum over the chosen samples / batch size: decomposes over ranks
                loss = loss + self.extra(h[even]).pow(2).sum() / len(targets)
        return loss


def make_model(cfg: dict, seed: int) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(cfg)


def make_data(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [steps, micro, p*b, SEQ], targets [steps, micro, p*b]; the same on every rank."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    n = cfg["world_size"] * cfg["batch"]
    ids = torch.randint(0, VOCAB, (cfg["steps"], cfg["micro"], n, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (cfg["steps"], cfg["micro"], n), generator=gen)
    if cfg["sometimes_used"]:  # step 0: rank 0's slice has odd targets only -> extra unused there
        b = cfg["batch"]
        targets[0, :, :b] = targets[0, :, :b] % 6 * 2 + 1  # 1, 3, ..., 11
        targets[0, :, b] = 4  # and rank 1 surely uses it
    return ids, targets


def _optimizer(model: nn.Module, cfg: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1)


def train_single(cfg: dict) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole batch (p*b samples x micro) per step."""
    model = make_model(cfg, cfg["seed"])  # rank 0's seed: what DDP broadcasts
    opt = _optimizer(model, cfg)
    ids, targets = make_data(cfg)
    for step in range(cfg["steps"]):
        loss = model(ids[step].flatten(0, 1), targets[step].flatten(0, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.state_dict().items()}


def _my_slice(comm, cfg: dict, tensor: torch.Tensor) -> torch.Tensor:
    b = cfg["batch"]
    return tensor[comm.rank * b : (comm.rank + 1) * b]


def train_ddp(comm, cfg: dict, comm_hook=None) -> dict:
    """Our DDP: rank-specific init (the broadcast must fix it), the rank's slice of each batch."""
    torch.manual_seed(0)
    model = make_model(cfg, cfg["seed"] + 1000 * comm.rank).to(comm.device)  # cuda:r under device="cuda"
    ddp = md.DistributedDataParallel(
        model,
        comm,
        bucket_mb=cfg["bucket_mb"],
        overlap=cfg["overlap"],
        find_unused_parameters=cfg["find_unused"],
        comm_hook=comm_hook,
    )
    opt = _optimizer(ddp, cfg)
    ids, targets = (t.to(comm.device) for t in make_data(cfg))
    k = cfg["micro"]
    for step in range(cfg["steps"]):
        for micro in range(k):
            batch = _my_slice(comm, cfg, ids[step, micro]), _my_slice(comm, cfg, targets[step, micro])
            # all but the last micro-step only accumulate; the last one communicates the sum
            with ddp.no_sync() if micro < k - 1 else contextlib.nullcontext():
                (ddp(*batch) / k).backward()
        opt.step()
        opt.zero_grad()
    return {
        "state": {name: p.detach().cpu().clone() for name, p in model.state_dict().items()},
        "buckets": ddp.buckets,
    }


def train_torch_ddp_and_ours(comm, cfg: dict) -> dict:
    """transport="torch": torch.nn.parallel.DistributedDataParallel (gloo) and ours, same data."""
    ours = train_ddp(comm, cfg)["state"]
    model = make_model(cfg, cfg["seed"] + 1000 * comm.rank)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=cfg["find_unused"])
    opt = _optimizer(ddp, cfg)
    ids, targets = make_data(cfg)
    for step in range(cfg["steps"]):
        loss = ddp(_my_slice(comm, cfg, ids[step, 0]), _my_slice(comm, cfg, targets[step, 0]))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"ours": ours, "torch": {name: p.detach().clone() for name, p in model.state_dict().items()}}


class CountingHook:
    """A comm hook that counts its calls and runs ``allreduce_average`` with the ring."""

    def __init__(self) -> None:
        self.calls = 0
        self.inner = functools.partial(allreduce_average, algorithm="ring")

    def __call__(self, comm, flat_grad, bucket_index):
        self.calls += 1
        return self.inner(comm, flat_grad, bucket_index)


def count_collectives(comm, cfg: dict) -> dict:
    """Per step: comm-hook calls, messages and bytes sent by this rank."""
    model = make_model(cfg, cfg["seed"])
    hook = CountingHook()
    ddp = md.DistributedDataParallel(model, comm, bucket_mb=cfg["bucket_mb"], comm_hook=hook)
    ids, targets = make_data(cfg)
    steps = []
    for step in range(cfg["steps"]):
        calls, before = hook.calls, comm.stats
        ddp(_my_slice(comm, cfg, ids[step, 0]), _my_slice(comm, cfg, targets[step, 0])).backward()
        delta = comm.stats - before
        steps.append(
            {"calls": hook.calls - calls, "messages": delta.messages_sent, "bytes": delta.bytes_sent}
        )
    grad_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    return {"steps": steps, "buckets": len(ddp.buckets), "grad_bytes": grad_bytes}


def unused_without_flag(comm, cfg: dict) -> None:
    model = make_model(cfg, cfg["seed"])
    ddp = md.DistributedDataParallel(model, comm, bucket_mb=cfg["bucket_mb"])
    ids, targets = make_data(cfg)
    ddp(_my_slice(comm, cfg, ids[0, 0]), _my_slice(comm, cfg, targets[0, 0])).backward()


def overlap_trace(comm, cfg: dict, layers: int, width: int) -> dict:
    """A deeper MLP with a recorder: returns the recorded events of two steps."""
    from minidist import trace

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
    rec = trace.Recorder(rank=comm.rank)
    ddp = md.DistributedDataParallel(
        model, comm, bucket_mb=cfg["bucket_mb"], overlap=cfg["overlap"], recorder=rec
    )
    x = torch.randn(16, width)
    for _ in range(2):
        ddp(x).pow(2).mean().backward()
    return {"events": rec.events, "buckets": len(ddp.buckets)}


def bucket_layout(comm, cfg: dict) -> list[list[str]]:
    model = make_model(cfg, cfg["seed"])
    return md.DistributedDataParallel(model, comm, bucket_mb=cfg["bucket_mb"]).buckets


def bert_batches(world_size: int, batch: int, seq: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and MLM labels [steps, p*b, seq]; every row labels the same number of
    positions, so the mean over labelled positions decomposes over the ranks exactly."""
    from minidist.models import bert

    gen = torch.Generator().manual_seed(5)
    vocab = bert.CONFIGS["tiny"].vocab_size
    ids = torch.randint(0, vocab, (steps, world_size * batch, seq), generator=gen)
    labels = torch.full_like(ids, bert.IGNORE_INDEX)
    labels[..., ::4] = ids[..., ::4]
    return ids, labels


def bert_single(world_size: int, batch: int, seq: int, steps: int) -> dict[str, torch.Tensor]:
    from minidist.models import bert

    torch.manual_seed(11)
    model = bert.BertForMLM(bert.CONFIGS["tiny"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = bert_batches(world_size, batch, seq, steps)
    for step in range(steps):
        model(ids[step], labels=labels[step]).loss.backward()
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"state": {name: p.detach().clone() for name, p in model.state_dict().items()}, "grads": grads}


def bert_ddp(comm, batch: int, seq: int, steps: int, bucket_mb: float) -> dict:
    from minidist.models import bert

    torch.manual_seed(11 + 1000 * comm.rank)
    ddp = md.DistributedDataParallel(bert.BertForMLM(bert.CONFIGS["tiny"]), comm, bucket_mb=bucket_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ids, labels = bert_batches(comm.world_size, batch, seq, steps)
    mine = slice(comm.rank * batch, (comm.rank + 1) * batch)
    for step in range(steps):
        ddp(ids[step, mine], labels=labels[step, mine]).loss.backward()
        if step == 0:
            grads = {name: p.grad.clone() for name, p in ddp.module.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {
        "state": {name: p.detach().clone() for name, p in ddp.module.state_dict().items()},
        "grads": grads,
        "buckets": ddp.buckets,
    }


class _MeanOfRows:
    """Handle whose ``wait()`` returns a NEW tensor: the mean of an allgather's rows."""

    def __init__(self, work) -> None:
        self.work = work

    def wait(self, timeout=None) -> torch.Tensor:
        return self.work.wait(timeout).mean(dim=0)


def allgather_mean_hook(comm, flat_grad: torch.Tensor, bucket_index: int) -> _MeanOfRows:
    """A comm hook that is not an in-place allreduce: DDP must copy its result back."""
    return _MeanOfRows(md.allgather(comm, flat_grad, async_op=True))


def train_ddp_allgather_hook(comm, cfg: dict) -> dict:
    return train_ddp(comm, cfg, comm_hook=allgather_mean_hook)


def average_buckets(comm, algorithm: str) -> list[torch.Tensor]:
    """allreduce_average of three rank-dependent buckets (an odd length, so ring chunks
    differ in size), each issued before the previous one is waited for."""
    works = []
    for index, numel in enumerate((7, 1000, 33)):
        gen = torch.Generator().manual_seed(100 * index + comm.rank)
        flat = torch.randn(numel, generator=gen)
        works.append(allreduce_average(comm, flat, index, algorithm=algorithm))
    return [work.wait(timeout=30) for work in works]
