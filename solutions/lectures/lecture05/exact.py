"""Workers for lecture 05, sections 5 to 8: accumulation, equality with one process, PyTorch's DDP,
the check of a comm hook."""

import contextlib
import pathlib
import time

import torch
import torch.nn.functional as F

import minidist as md
from minidist import data
from minidist.models import bert
from minidist.parallel.compression.baselines import bf16_allreduce
from minidist.parallel.ddp import DistributedDataParallel


def shard_mean_loss(logits, labels, shards):
    """The mean over `shards` (lists of row indices) of each shard's mean MLM loss."""
    losses = [
        F.cross_entropy(logits[rows].flatten(0, 1), labels[rows].flatten(), ignore_index=data.IGNORE_INDEX)
        for rows in shards
    ]
    return torch.stack(losses).mean()


def rows_of_step(num_samples, rank, world_size, step, per_rank):
    """The rows rank `rank` reads in step `step`: a slice of its DistributedSampler's indices."""
    mine = list(data.DistributedSampler(num_samples, rank, world_size, seed=0))
    return mine[step * per_rank : (step + 1) * per_rank]


def build(config_name, comm=None, kind="ours", **ddp_options):
    """BERT `config_name` from seed 0, wrapped in our DDP, PyTorch's, or nothing (kind "none")."""
    torch.manual_seed(0)
    model = bert.BertForMLM(bert.CONFIGS[config_name])
    if kind == "ours":
        return model, DistributedDataParallel(model, comm, **ddp_options)
    if kind == "torch":
        return model, torch.nn.parallel.DistributedDataParallel(model, **ddp_options)
    return model, model


def accumulate(comm, config_name, input_ids, labels, per_rank, micro_steps):
    """Section 5: one step's gradient from `micro_steps` micro-batches; messages sent per backward."""
    model, ddp = build(config_name, comm, bucket_mb=1.0)
    rows = rows_of_step(len(input_ids), comm.rank, comm.world_size, 0, per_rank)
    sent = []
    for j, micro in enumerate(torch.tensor(rows).chunk(micro_steps)):
        last = j == micro_steps - 1
        before = comm.stats.copy()
        with contextlib.nullcontext() if last else ddp.no_sync():
            (ddp(input_ids[micro], labels=labels[micro]).loss / micro_steps).backward()
        sent.append((comm.stats - before).messages_sent)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return dict(grads=grads, messages=sent)


def train(comm, config_name, input_ids, labels, per_rank, steps, lr, kind="ours", **ddp_options):
    """Sections 6 and 7: `steps` AdamW steps under our DDP or PyTorch's; parameters and step times."""
    model, ddp = build(config_name, comm, kind, **ddp_options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    seconds, losses = [], []
    for step in range(steps):
        rows = rows_of_step(len(input_ids), comm.rank, comm.world_size, step, per_rank)
        start = time.perf_counter()
        loss = ddp(input_ids[rows], labels=labels[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    return dict(state=state, seconds=seconds, losses=losses)


def sections_5_to_7(comm, config_name, input_ids, labels, per_rank, micro_steps, steps, lr):
    """Everything sections 5, 6 and 7 need, in one start of the processes."""
    return dict(
        accumulate=accumulate(comm, config_name, input_ids, labels, per_rank, micro_steps),
        ours=train(comm, config_name, input_ids, labels, per_rank, steps, lr, "ours", bucket_mb=1.0),
        torch=train(comm, config_name, input_ids, labels, per_rank, steps, lr, "torch", bucket_cap_mb=1.0),
    )


def compare_hooks(comm, config_name, input_ids, labels, per_rank, hook):
    """Section 8's check: one backward of BERT under our DDP with the default (float32) averaging
    and with the comm hook `hook`; per run, the averaged gradient (one flat vector) and the bytes
    this rank sent."""
    results = {}
    for name, comm_hook in [("float32", None), ("hook", hook)]:
        model, ddp = build(config_name, comm, bucket_mb=1.0, comm_hook=comm_hook)
        rows = rows_of_step(len(input_ids), comm.rank, comm.world_size, 0, per_rank)
        before = comm.stats.copy()
        # the library's bf16 averaging is switched off while your hook runs (Try it 3 asks for yours)
        off = [bf16_allreduce] if name == "hook" else []
        with md.switched_off("Try it 3", *off):
            ddp(input_ids[rows], labels=labels[rows]).loss.backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        results[name] = dict(grad=grad, bytes=(comm.stats - before).bytes_sent)
    return results


def returns_at_once(comm, hook, flag_file, patience=10.0):
    """Whether `hook` starts its allreduce and returns without waiting for it, as DDP needs in
    order to overlap: rank 1 calls its hook only once rank 0's hook has returned (rank 0 then
    creates `flag_file`), so a hook that waits for the sum on rank 0 keeps rank 1 out of the
    allreduce for good, and rank 1 says so after `patience` seconds. Returns the average."""
    assert comm.world_size == 2
    flat = torch.full((4096,), float(comm.rank + 1))
    flag = pathlib.Path(flag_file)
    if comm.rank == 0:
        with md.switched_off("Try it 3", bf16_allreduce):
            handle = hook(comm, flat, 0)
        flag.touch()  # reached only when the hook returned before rank 1 joined the allreduce
    else:
        deadline = time.monotonic() + patience
        while not flag.exists():
            assert time.monotonic() < deadline, (
                f"rank 0's hook did not return within {patience:g} s while rank 1 stayed out of the "
                "allreduce: it waits for the sum. Start the allreduce with async_op=True and return "
                "a handle at once; DDP calls wait() later, after the rest of backward"
            )
            time.sleep(0.01)
        with md.switched_off("Try it 3", bf16_allreduce):
            handle = hook(comm, flat, 0)
    with md.switched_off("Try it 3", bf16_allreduce):
        return handle.wait().clone()
