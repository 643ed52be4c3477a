"""Worker functions for tests/lib/parallel/test_sequence_parallel.py (importable by md.launch workers).

The test process builds the dense models and inputs (``decoder_case``, ``block_case``) and computes
the dense reference itself; the workers run tensor parallelism without and with sequence
parallelism on the same tensors and return what they computed, what they counted (collectives by
``tp.count_collectives`` and ``tp.count_sequence_collectives``, payload bytes by ``comm.stats``)
and the bytes autograd saved for backward (``measure.saved_tensors``). One configuration serves
t = 2, 3 and 4: 12 heads, ffn 192, vocabulary 96 and 12 tokens all divide by each.
"""

from __future__ import annotations

import torch

from minidist import measure
from minidist.models import decoder, transformer
from minidist.models.tp_decoder import TensorParallelDecoderLM
from minidist.parallel import tensor as tp

D, HEADS, VOCAB, BATCH, SEQ = 48, 12, 96, 2, 12  # ffn = 4 D = 192 (the paper's MLP)

# the three ways of running the decoder in one launch
VARIANTS = {
    "tp": dict(sequence_parallel=False),
    "sp": dict(sequence_parallel=True),
    "sp_keep_gathered": dict(sequence_parallel=True, keep_gathered=True),
}


def decoder_config(
    position: str = "learned", embedding_layernorm: bool = False, n_layers: int = 2
) -> transformer.TransformerConfig:
    return transformer.TransformerConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        n_layers=n_layers,
        n_heads=HEADS,
        max_positions=16,
        position=position,
        causal=True,
        pre_ln=True,
        embedding_layernorm=embedding_layernorm,
        layer_norm_eps=1e-5,
    )


DECODER_CONFIGS = {
    "learned-2-layers": decoder_config(),
    # ALiBi + padding (a (B, H, S, S) bias), the BLOOM embedding LayerNorm, one layer
    "alibi-embedding-ln-1-layer": decoder_config("alibi", embedding_layernorm=True, n_layers=1),
}


def decoder_case(name: str, seed: int = 0) -> dict:
    """A dense DecoderLM's state (seeded, non-trivial LayerNorms and biases), ids, labels, mask."""
    torch.manual_seed(seed)
    model = decoder.DecoderLM(DECODER_CONFIGS[name])
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn(p.shape) * 0.05)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 3] = labels[1, 7] = decoder.IGNORE_INDEX
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if DECODER_CONFIGS[name].position == "alibi":
        mask[1, -3:] = 0
    return {"name": name, "state": model.state_dict(), "ids": ids, "labels": labels, "mask": mask}


def block_case(seed: int = 0) -> dict:
    """One block's dense weights (a 1-layer decoder's state), its input and an upstream gradient."""
    torch.manual_seed(seed)
    model = decoder.DecoderLM(decoder_config(n_layers=1))
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "state": model.state_dict(),
        "x": torch.randn(BATCH, SEQ, D, generator=g),
        "gy": torch.randn(BATCH, SEQ, D, generator=g),
    }


def _reset(comm) -> None:
    tp.reset_collective_counts(comm)
    tp.reset_sequence_collective_counts(comm)


def _counts(comm) -> dict:
    """Per phase: allreduce and allgather (f, g, the loss, LayerNorm gradients) and the sequence
    collectives, in one dict."""
    ops = tp.count_collectives(comm)
    seq = tp.count_sequence_collectives(comm)
    return {
        phase: {
            "allreduce": ops[phase]["allreduce"],
            "allgather": ops[phase]["allgather"] + seq[phase]["allgather"],
            "reduce_scatter": seq[phase]["reduce_scatter"],
        }
        for phase in ("forward", "backward")
    }


def decoder_check(comm, case: dict, options: dict) -> dict:
    """One decoder variant on the case: loss, gathered logits, every gradient, counts, bytes sent."""
    dense = decoder.DecoderLM(DECODER_CONFIGS[case["name"]])
    dense.load_state_dict(case["state"])
    model = TensorParallelDecoderLM.from_dense(dense, comm, **options)
    _reset(comm)
    start = comm.stats.copy()
    out = model(case["ids"], labels=case["labels"], attention_mask=case["mask"])
    middle = comm.stats.copy()
    out.loss.backward()
    end = comm.stats.copy()
    counts = _counts(comm)
    with torch.no_grad():
        logits = model.gather_logits(out.logits)
    return {
        "loss": out.loss.detach(),
        "logits": logits,
        "grads": {n: q.grad for n, q in model.named_parameters()},
        "counts": counts,
        "bytes": {"forward": (middle - start).bytes_sent, "backward": (end - middle).bytes_sent},
    }


def _block(comm, case: dict, options: dict):
    dense = decoder.DecoderLM(decoder_config(n_layers=1))
    dense.load_state_dict(case["state"])
    return TensorParallelDecoderLM.from_dense(dense, comm, **options).transformer.blocks[0]


def block_check(comm, case: dict, options: dict) -> dict:
    """One block: bytes sent per phase, counts, and the bytes it saves for backward on this rank."""
    block = _block(comm, case, options)
    bias = transformer.attention_bias(decoder_config(), SEQ, None, torch.float32, torch.device("cpu"))
    x, gy = case["x"], case["gy"]
    if options["sequence_parallel"]:  # the block's input and output are this rank's tokens
        x, gy = x.chunk(comm.world_size, dim=1)[comm.rank], gy.chunk(comm.world_size, dim=1)[comm.rank]
    # memory: x does not require grad (saved_tensors leaves out leaves that do, as parameters)
    y, records = measure.saved_tensors(block, x.clone(), bias)
    saved = sum(r.storage_bytes for r in records if r.new_storage)
    del y, records
    # bytes: a forward and a backward
    x = x.clone().requires_grad_(True)
    _reset(comm)
    start = comm.stats.copy()
    y = block(x, bias)
    middle = comm.stats.copy()
    (y * gy).sum().backward()
    end = comm.stats.copy()
    return {
        "y": y.detach(),
        "gx": x.grad,
        "saved_bytes": saved,
        "counts": _counts(comm),
        "bytes": {"forward": (middle - start).bytes_sent, "backward": (end - middle).bytes_sent},
    }


def all_checks(comm, decoders: list[dict], block: dict) -> dict:
    """One launch per world size: every decoder case and the block, in every variant."""
    return {
        "decoders": [{v: decoder_check(comm, c, o) for v, o in VARIANTS.items()} for c in decoders],
        "block": {v: block_check(comm, block, o) for v, o in VARIANTS.items()},
    }
