"""Workers for lecture 02, section 6: updating an embedding table from sparse gradients."""

import hashlib

import torch

import minidist as md


def touched_rows(rank, vocab, dim, k):
    """The rows of the table rank `rank` touched this step, and its gradient for them."""
    g = torch.Generator().manual_seed(1000 + rank)
    rows = torch.randperm(vocab, generator=g)[:k]  # distinct rows; other ranks may overlap
    return rows, torch.randn(k, dim, generator=g)


def dense_update(comm, table, rows, grads, lr):
    """Scatter the rows into a full-size gradient, allreduce (average) it, take a step."""
    dense = torch.zeros_like(table)
    dense.index_add_(0, rows, grads)
    md.allreduce(comm, dense, op="avg", algorithm="ring")
    table.sub_(lr * dense)


def sparse_update(comm, table, rows, grads, lr):
    """Allgather everyone's (row, gradient) pairs and apply them all locally."""
    count = torch.tensor([rows.numel()])
    counts = md.allgather(comm, count).view(-1)  # allgather needs equal sizes: pad to the max
    k = int(counts.max())
    padded_rows = torch.zeros(k, dtype=torch.int64)
    padded_grads = torch.zeros(k, grads.shape[1])
    padded_rows[: rows.numel()], padded_grads[: rows.numel()] = rows, grads
    all_rows = md.allgather(comm, padded_rows)  # (p, k)
    all_grads = md.allgather(comm, padded_grads)  # (p, k, dim)
    for r in range(comm.world_size):  # in rank order, on every rank: identical results
        n = int(counts[r])
        table.index_add_(0, all_rows[r, :n], all_grads[r, :n], alpha=-lr / comm.world_size)


def compare_updates(comm, table, ks, lr):
    """For each k: update a copy of `table` both ways; return bytes sent and the results."""
    vocab, dim = table.shape
    results = []
    for k in ks:
        rows, grads = touched_rows(comm.rank, vocab, dim, k + comm.rank)  # ranks touch k..k+p-1 rows
        out = {"k": k}
        for name, update in [("dense", dense_update), ("sparse", sparse_update)]:
            mine = table.clone()  # never modify the caller's (shared) table
            before = comm.stats
            update(comm, mine, rows, grads, lr)
            out[f"{name} bytes"] = (comm.stats - before).bytes_sent
            out[f"{name} fingerprint"] = hashlib.sha1(mine.numpy().tobytes()).hexdigest()
            if comm.rank == 0:  # one copy of the table is enough
                out[name] = mine
        results.append(out)
    return results
