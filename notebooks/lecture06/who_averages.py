"""Lecture 06, section 2: one BERT step with its gradients averaged by each architecture.

One launch holds the largest world needed (workers + summation servers); for each
(architecture, workers, servers) the first workers + servers ranks form a group
(``SubComm``), the rest wait at the barrier. Bytes are measured with ``comm.stats``.
"""

import math

import torch

from minidist.models import bert
from minidist.parallel import averaging
from minidist.parallel.ddp import DistributedDataParallel
from minidist.parallel.group import SubComm


def one_setup(comm, arch, n, k, model_name, batches, steps, lr):
    """Rank `comm.rank` of one architecture: train `steps` SGD steps (worker) or sum (server)."""
    servers = averaging.servers_for(arch, k)
    full = SubComm(comm, range(n + servers))
    if full.rank >= n:  # a summation server: it returns when every worker sent "stop"
        before = full.stats
        averaging.serve_summation(full, list(range(n)))
        delta = full.stats - before
        return {"role": "server", "sent": delta.bytes_sent / steps}
    hook = averaging.make_hook(arch, full, n, k)
    try:
        torch.manual_seed(0)
        model = bert.BertForMLM(bert.CONFIGS[model_name])
        ddp = DistributedDataParallel(
            model, SubComm(full, range(n)), bucket_mb=math.inf, overlap=False, comm_hook=hook
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        before = full.stats  # after DDP's initial broadcast
        for ids, labels in batches[:steps]:
            mine = torch.arange(len(ids)).chunk(n)[full.rank]
            ddp(ids[mine], labels=labels[mine]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        delta = full.stats - before
        ddp.remove_hooks()
    finally:
        hook.close()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {
        "role": "worker",
        "sent": delta.bytes_sent / steps,
        "received": delta.bytes_received / steps,
        "params": params,
    }


def all_setups(comm, setups, model_name, batches, steps, lr):
    """Every (arch, n, k) in `setups`, one after another; worker 0 keeps the parameters."""
    out = []
    for arch, n, k in setups:
        comm.barrier()
        if comm.rank < n + averaging.servers_for(arch, k):
            result = one_setup(comm, arch, n, k, model_name, batches, steps, lr)
            if comm.rank != 0:
                result.pop("params", None)
            out.append(result)
        else:
            out.append(None)
    comm.barrier()
    return out
