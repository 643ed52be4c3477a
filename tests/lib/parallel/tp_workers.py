"""Worker functions for tests/lib/parallel/test_tensor_parallel.py (importable by md.launch workers).

The test process builds every dense weight and input (``module_case``, ``decoder_case``) and
computes the dense reference itself; the workers only run the tensor-parallel layers on those
tensors and return what they computed (moved to the CPU). Collectives are counted twice: by
``tp.count_collectives`` (the layers' own claim) and by a wrapper put around
``minidist.collectives.allreduce``/``allgather`` here (``CallLog``), which knows nothing about
phases: it only sees how many calls happened before and after ``backward()`` started.
"""

from __future__ import annotations

import contextlib

import torch

from minidist import collectives
from minidist.models import decoder, transformer
from minidist.models.tp_decoder import TensorParallelDecoderLM
from minidist.parallel import tensor as tp

D, HEADS, FFN, VOCAB, BATCH, SEQ = 64, 4, 256, 128, 2, 8


def attention_config(alibi: bool = True) -> transformer.TransformerConfig:
    return transformer.TransformerConfig(
        vocab_size=VOCAB,
        hidden_size=D,
        n_layers=1,
        n_heads=HEADS,
        max_positions=SEQ,
        intermediate_size=FFN,
        position="alibi" if alibi else "learned",
        causal=True,
        pre_ln=True,
    )


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
    "learned": decoder_config(),
    # 3 layers here, 2 above: the collective counts must grow by exactly 2 + 2 per layer
    "alibi-embedding-ln-3-layers": decoder_config("alibi", embedding_layernorm=True, n_layers=3),
}


def module_case(seed: int = 0) -> dict:
    """Dense weights and inputs for the single-module checks (built by the test, passed to workers)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    cfg = attention_config()
    torch.manual_seed(seed)
    mlp = transformer.MLP(cfg)
    attention = transformer.MultiHeadSelfAttention(cfg)
    for module in (mlp, attention):  # non-zero biases, so that a bias added twice shows
        for p in module.parameters():
            with torch.no_grad():
                p.copy_(randn(*p.shape, scale=0.1))
    labels = torch.randint(0, VOCAB, (BATCH * SEQ,), generator=g)
    labels[::5] = decoder.IGNORE_INDEX
    return {
        "col_w": randn(FFN, D, scale=0.1),
        "col_b": randn(FFN, scale=0.1),
        "row_w": randn(D, FFN, scale=0.1),
        "row_b": randn(D, scale=0.1),
        "x": randn(BATCH, SEQ, D),
        "x_ffn": randn(BATCH, SEQ, FFN),
        "gy_ffn": randn(BATCH, SEQ, FFN),
        "gy": randn(BATCH, SEQ, D),
        "mlp": mlp.state_dict(),
        "attention": attention.state_dict(),
        "bias": transformer.attention_bias(cfg, SEQ, None, torch.float32, torch.device("cpu")),
        "table": randn(VOCAB, D),
        "ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        "logits": randn(BATCH * SEQ, VOCAB, scale=3.0),
        "labels": labels,
    }


def decoder_case(name: str, seed: int = 0) -> dict:
    """A dense DecoderLM's state (seeded), input ids and labels with some ignored positions."""
    torch.manual_seed(seed)
    model = decoder.DecoderLM(DECODER_CONFIGS[name])
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a wrong copy would show
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.add_(torch.randn(p.shape) * 0.05)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, 3] = labels[1, 5] = decoder.IGNORE_INDEX
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    if DECODER_CONFIGS[name].position == "alibi":  # padding too: the bias becomes (B, H, T, T)
        mask[1, -2:] = 0
    return {"name": name, "state": model.state_dict(), "ids": ids, "labels": labels, "mask": mask}


class CallLog:
    """Counts calls of minidist.collectives.allreduce/allgather made while installed."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @contextlib.contextmanager
    def installed(self):
        originals = {name: getattr(collectives, name) for name in ("allreduce", "allgather")}

        def wrap(name):
            def counted(*args, **kwargs):
                self.calls.append(name)
                return originals[name](*args, **kwargs)

            return counted

        try:
            for name in originals:
                setattr(collectives, name, wrap(name))
            yield self
        finally:
            for name, fn in originals.items():
                setattr(collectives, name, fn)

    def tally(self, start: int = 0, stop: int | None = None) -> dict:
        window = self.calls[start:stop]
        return {"allreduce": window.count("allreduce"), "allgather": window.count("allgather")}


def _cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


def _run_counted(comm, forward, backward) -> dict:
    """Run forward() then backward(out); return outputs plus both counts of collectives."""
    log = CallLog()
    tp.reset_collective_counts(comm)
    with log.installed():
        out = forward()
        n_forward = len(log.calls)
        backward(out)
    return {
        "out": out,
        "claimed": tp.count_collectives(comm),
        "observed": {"forward": log.tally(0, n_forward), "backward": log.tally(n_forward)},
    }


def _counted(run: dict) -> dict:
    return {"claimed": run["claimed"], "observed": run["observed"]}


def _leaf(t: torch.Tensor, dev) -> torch.Tensor:
    return t.to(dev).clone().requires_grad_(True)


def module_checks(comm, case: dict) -> dict:
    """Every single tensor-parallel module on the case's tensors: outputs, input and weight grads, counts."""
    dev, r, p = comm.device, comm.rank, comm.world_size
    case = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    res = {}

    # column-parallel, gathered and not
    for gather in (True, False):
        layer = tp.ColumnParallelLinear(D, FFN, comm, gather_output=gather)
        layer.load_dense(case["col_w"], case["col_b"])
        x = _leaf(case["x"], dev)
        gy = case["gy_ffn"] if gather else case["gy_ffn"].chunk(p, dim=-1)[r]
        run = _run_counted(comm, lambda: layer(x), lambda y: (y * gy).sum().backward())
        res[f"column_gather={gather}"] = dict(
            y=run["out"], gx=x.grad, gw=layer.weight.grad, gb=layer.bias.grad, **_counted(run)
        )

    # row-parallel, input split or full
    for parallel_in in (True, False):
        layer = tp.RowParallelLinear(FFN, D, comm, input_is_parallel=parallel_in)
        layer.load_dense(case["row_w"], case["row_b"])
        x = _leaf(case["x_ffn"].chunk(p, dim=-1)[r] if parallel_in else case["x_ffn"], dev)
        run = _run_counted(comm, lambda: layer(x), lambda y: (y * case["gy"]).sum().backward())
        res[f"row_parallel_input={parallel_in}"] = dict(
            y=run["out"], gx=x.grad, gw=layer.weight.grad, gb=layer.bias.grad, **_counted(run)
        )

    # MLP and attention (ALiBi + causal bias with a head dimension)
    cfg = attention_config()
    dense_mlp = transformer.MLP(cfg).to(dev)
    dense_mlp.load_state_dict(case["mlp"])
    mlp = tp.ParallelMLP(D, FFN, comm)
    mlp.load_dense(dense_mlp)
    dense_attention = transformer.MultiHeadSelfAttention(cfg).to(dev)
    dense_attention.load_state_dict(case["attention"])
    attention = tp.ParallelSelfAttention(D, HEADS, comm)
    attention.load_dense(dense_attention)
    for name, module, call in (
        ("mlp", mlp, lambda m, x: m(x)),
        ("attention", attention, lambda m, x: m(x, case["bias"])),
    ):
        x = _leaf(case["x"], dev)
        run = _run_counted(
            comm, lambda m=module, c=call, x=x: c(m, x), lambda y: (y * case["gy"]).sum().backward()
        )
        res[name] = dict(
            y=run["out"], gx=x.grad, grads={n: q.grad for n, q in module.named_parameters()}, **_counted(run)
        )

    # vocabulary-parallel embedding
    embedding = tp.VocabParallelEmbedding(VOCAB, D, comm)
    embedding.load_dense(case["table"])
    run = _run_counted(comm, lambda: embedding(case["ids"]), lambda y: (y * case["gy"]).sum().backward())
    res["embedding"] = dict(
        y=run["out"], gw=embedding.weight.grad, claimed=run["claimed"], observed=run["observed"]
    )

    # vocabulary-parallel cross-entropy
    local = _leaf(case["logits"].chunk(p, dim=-1)[r], dev)
    run = _run_counted(
        comm,
        lambda: tp.vocab_parallel_cross_entropy(local, case["labels"], comm),
        lambda loss: loss.backward(),
    )
    res["cross_entropy"] = dict(
        loss=run["out"], grad=local.grad, claimed=run["claimed"], observed=run["observed"]
    )
    return _cpu(res)


def decoder_check(comm, case: dict) -> dict:
    """TensorParallelDecoderLM.from_dense on the case's dense model: loss, gathered logits, grads, counts."""
    dev = comm.device
    dense = decoder.DecoderLM(DECODER_CONFIGS[case["name"]]).to(dev)
    dense.load_state_dict(case["state"])
    model = TensorParallelDecoderLM.from_dense(dense, comm)
    ids, labels = case["ids"].to(dev), case["labels"].to(dev)
    mask = case["mask"].to(dev)
    run = _run_counted(
        comm, lambda: model(ids, labels=labels, attention_mask=mask), lambda out: out.loss.backward()
    )
    with torch.no_grad():
        logits = model.gather_logits(run["out"].logits)
    return _cpu(
        {
            "loss": run["out"].loss,
            "local_logits_shape": tuple(run["out"].logits.shape),
            "logits": logits,
            "grads": {n: q.grad for n, q in model.named_parameters()},
            "claimed": run["claimed"],
            "observed": run["observed"],
        }
    )


def all_checks(comm, module: dict, decoders: list[dict]) -> dict:
    """One launch per world size: the module checks and every decoder case."""
    return {"modules": module_checks(comm, module), "decoders": [decoder_check(comm, c) for c in decoders]}
