"""Lecture 06, section 3: BERT MLM on 2 ranks through our DDP, once per compressor (dense, DGC, ...)."""

import math

import torch

from minidist.models import bert
from minidist.parallel.compression import ablation
from minidist.parallel.ddp import DistributedDataParallel
from minidist.transport.emulated import ETHERNET_10G, EmulatedLinkComm


def train_rows(comm, cfg, rows, batches):
    """Train BERT from the same weights on the same batches once per row; per row: losses, bytes sent."""
    comm = EmulatedLinkComm(comm, *ETHERNET_10G)  # every byte a message, counted by comm.stats
    out = {}
    for row in rows:
        torch.manual_seed(cfg.seed)
        model = bert.BertForMLM(bert.CONFIGS[cfg.model])
        hook = ablation.make_hook(cfg, row)  # dense, DGC (maybe one component off), bf16, sign EF
        ddp = DistributedDataParallel(model, comm, bucket_mb=math.inf, overlap=False, comm_hook=hook)
        momentum_in_hook = row.hook == "dgc" and ablation.dgc_config(cfg, row).momentum_correction
        momentum = 0.0 if momentum_in_hook else cfg.momentum  # DGC keeps the velocity itself
        optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=momentum)
        losses, sent = [], []
        for ids, labels in batches:
            mine = torch.arange(len(ids)).chunk(comm.world_size)[comm.rank]
            before = comm.stats
            loss = ddp(ids[mine], labels=labels[mine]).loss
            loss.backward()  # the hook runs: .grad holds the average (dense) or the sparse sum / N
            if row.hook != "dgc":  # DGC clipped inside the hook, before compressing
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            sent.append((comm.stats - before).bytes_sent)
        ddp.remove_hooks()
        out[row.label] = {"losses": losses, "sent": sent}
    return out
