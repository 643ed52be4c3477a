"""Megatron tensor parallelism (``minidist.parallel.tensor``, ``minidist.models.tp_decoder``).

Every result of the p ranks is compared with the dense computation done here, in the test
process, on the same tensors: outputs, the input's gradient, and every parameter's gradient
(a split parameter's gradient with the matching slice of the dense gradient, a replicated one
with the whole). One ``md.launch`` per world size (2 and 4) runs all the checks
(``tp_workers.all_checks``); the tests below read its results.

Tolerance: fp32, ``atol=1e-5, rtol=1e-4`` (sums over the ranks add in another order than the
dense matmul, which moves the last bits only).

Collectives are counted twice: ``tp.count_collectives`` (counted where the layers call them)
and a wrapper around ``minidist.collectives.allreduce/allgather`` installed in the worker, which
only sees the calls made before and after ``backward()`` starts; both must equal the formula.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minidist as md
import tp_workers as w
from minidist.models import decoder, transformer
from minidist.models.tp_decoder import TensorParallelDecoderLM, check_tp_config
from minidist.parallel import tensor as tp
from minidist.transport.base import BaseComm

pytestmark = pytest.mark.timeout(180)

ATOL, RTOL = 1e-5, 1e-4
WORLD_SIZES = (2, 4)


def close(got, want, what=""):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def counts(fwd_allreduce, bwd_allreduce, fwd_allgather=0, bwd_allgather=0) -> dict:
    return {
        "forward": {"allreduce": fwd_allreduce, "allgather": fwd_allgather},
        "backward": {"allreduce": bwd_allreduce, "allgather": bwd_allgather},
    }


def assert_counts(result: dict, expected: dict, what: str) -> None:
    assert result["observed"] == expected, f"{what}: wrapped collectives saw {result['observed']}"
    assert result["claimed"] == expected, f"{what}: tp.count_collectives says {result['claimed']}"


def shard(t: torch.Tensor, dim: int, rank: int, p: int) -> torch.Tensor:
    return t.chunk(p, dim=dim)[rank]


# --- the runs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def module_case():
    return w.module_case(seed=0)


@pytest.fixture(scope="module")
def decoder_cases():
    return [w.decoder_case(name, seed=3) for name in w.DECODER_CONFIGS]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda p: f"tp{p}")
def run(request, module_case, decoder_cases):
    p = request.param
    outs = md.launch(w.all_checks, p, args=(module_case, decoder_cases), timeout=120, threads_per_worker=1)
    return p, outs


# --- dense references (in this process) ---------------------------------------------------------
def dense_linear(case, w_key, b_key, x_key, gy_key):
    weight = case[w_key].clone().requires_grad_(True)
    bias = case[b_key].clone().requires_grad_(True)
    x = case[x_key].clone().requires_grad_(True)
    y = F.linear(x, weight, bias)
    (y * case[gy_key]).sum().backward()
    return y.detach(), x.grad, weight.grad, bias.grad


def dense_module(module, case, *extra):
    x = case["x"].clone().requires_grad_(True)
    y = module(x, *extra)
    (y * case["gy"]).sum().backward()
    return y.detach(), x.grad, {n: q.grad for n, q in module.named_parameters()}


# --- single modules -----------------------------------------------------------------------------
def test_column_parallel_linear(run, module_case):
    p, outs = run
    y, gx, gw, gb = dense_linear(module_case, "col_w", "col_b", "x", "gy_ffn")
    for r, out in enumerate(outs):
        gathered, local = out["modules"]["column_gather=True"], out["modules"]["column_gather=False"]
        close(gathered["y"], y, f"rank {r} gathered output")
        close(local["y"], shard(y, -1, r, p), f"rank {r} local output")
        for res in (gathered, local):
            close(res["gx"], gx, f"rank {r} input grad (f's allreduce)")
            close(res["gw"], shard(gw, 0, r, p), f"rank {r} weight rows")
            close(res["gb"], shard(gb, 0, r, p), f"rank {r} bias")
        assert_counts(gathered, counts(0, 1, fwd_allgather=1), "column gather_output=True")
        assert_counts(local, counts(0, 1), "column gather_output=False")


def test_row_parallel_linear(run, module_case):
    p, outs = run
    y, gx, gw, gb = dense_linear(module_case, "row_w", "row_b", "x_ffn", "gy")
    for r, out in enumerate(outs):
        split_in, full_in = (
            out["modules"]["row_parallel_input=True"],
            out["modules"]["row_parallel_input=False"],
        )
        for res in (split_in, full_in):
            close(res["y"], y, f"rank {r} output")
            close(res["gw"], shard(gw, 1, r, p), f"rank {r} weight columns")
            close(res["gb"], gb, f"rank {r} replicated bias (added once, after g)")
        close(split_in["gx"], shard(gx, -1, r, p), f"rank {r} input slice grad")
        close(full_in["gx"], gx, f"rank {r} full input grad (allgathered)")
        assert_counts(split_in, counts(1, 0), "row input_is_parallel=True")
        assert_counts(full_in, counts(1, 0, bwd_allgather=1), "row input_is_parallel=False")


SPLIT_ROWS = ("query.", "key.", "value.", "up.", "word.")  # weight rows (and bias) split
SPLIT_COLUMNS = ("output.weight", "down.weight")  # weight columns split


def expected_grad(name: str, dense_grad: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """The slice of a dense gradient rank ``rank`` holds, by the documented layout."""
    if any(key in name for key in SPLIT_COLUMNS):
        return shard(dense_grad, 1, rank, p)
    if any(key in name for key in SPLIT_ROWS):
        return shard(dense_grad, 0, rank, p)
    return dense_grad


def test_parallel_mlp(run, module_case):
    p, outs = run
    mlp = transformer.MLP(w.attention_config())
    mlp.load_state_dict(module_case["mlp"])
    y, gx, grads = dense_module(mlp, module_case)
    for r, out in enumerate(outs):
        res = out["modules"]["mlp"]
        close(res["y"], y, f"rank {r} MLP output")
        close(res["gx"], gx, f"rank {r} MLP input grad")
        assert res["grads"].keys() == grads.keys()
        for name, g in grads.items():
            close(res["grads"][name], expected_grad(name, g, r, p), f"rank {r} MLP {name}")
        assert_counts(res, counts(1, 1), "MLP: one g forward, one f backward")


def test_parallel_attention_with_alibi_and_causal_mask(run, module_case):
    p, outs = run
    bias = module_case["bias"]
    assert bias.shape == (1, w.HEADS, w.SEQ, w.SEQ)  # per-head ALiBi plus the causal mask
    attention = transformer.MultiHeadSelfAttention(w.attention_config())
    attention.load_state_dict(module_case["attention"])
    y, gx, grads = dense_module(attention, module_case, bias)
    for r, out in enumerate(outs):
        res = out["modules"]["attention"]
        close(res["y"], y, f"rank {r} attention output")
        close(res["gx"], gx, f"rank {r} attention input grad")
        assert res["grads"].keys() == grads.keys()
        for name, g in grads.items():
            close(res["grads"][name], expected_grad(name, g, r, p), f"rank {r} attention {name}")
        assert_counts(res, counts(1, 1), "attention: one f for Q, K, V together, one g")


def test_vocab_parallel_embedding(run, module_case):
    p, outs = run
    table = module_case["table"].clone().requires_grad_(True)
    y = F.embedding(module_case["ids"], table)
    (y * module_case["gy"]).sum().backward()
    for r, out in enumerate(outs):
        res = out["modules"]["embedding"]
        close(res["y"], y.detach(), f"rank {r} embedding output")
        close(res["gw"], shard(table.grad, 0, r, p), f"rank {r} table rows")
        assert_counts(res, counts(1, 0), "embedding")


def test_vocab_parallel_cross_entropy_with_ignore_index(run, module_case):
    p, outs = run
    labels = module_case["labels"]
    assert (labels == -100).any()
    logits = module_case["logits"].clone().requires_grad_(True)
    loss = F.cross_entropy(logits, labels, ignore_index=-100)
    loss.backward()
    for r, out in enumerate(outs):
        res = out["modules"]["cross_entropy"]
        close(res["loss"], loss.detach(), f"rank {r} loss")
        close(res["grad"], shard(logits.grad, 1, r, p), f"rank {r} logits grad")
        assert_counts(res, counts(2, 0), "cross-entropy: max, then [sum exp, target logit]")


# --- the decoder --------------------------------------------------------------------------------
def dense_decoder(case):
    model = decoder.DecoderLM(w.DECODER_CONFIGS[case["name"]])
    model.load_state_dict(case["state"])
    out = model(case["ids"], labels=case["labels"], attention_mask=case["mask"])
    out.loss.backward()
    return model, out


def test_decoder_equals_dense_model(run, decoder_cases):
    p, outs = run
    for i, case in enumerate(decoder_cases):
        model, out = dense_decoder(case)
        grads = {n: q.grad for n, q in model.named_parameters()}
        for r, rank_out in enumerate(outs):
            res = rank_out["decoders"][i]
            what = f"{case['name']} tp{p} rank {r}"
            assert res["local_logits_shape"] == (w.BATCH, w.SEQ, w.VOCAB // p)
            close(res["logits"], out.logits.detach(), f"{what} logits")
            close(res["loss"], out.loss.detach(), f"{what} loss")
            assert res["grads"].keys() == grads.keys(), f"{what}: parameter names differ from DecoderLM's"
            for name, g in grads.items():
                close(res["grads"][name], expected_grad(name, g, r, p), f"{what} grad {name}")


def test_decoder_collective_counts(run, decoder_cases):
    # forward:  1 (embedding g) + 2 per layer (attention g, MLP g) + 2 (cross-entropy)
    # backward: 2 per layer (attention f, MLP f) + 1 (f in front of the tied output matrix)
    p, outs = run
    for i, case in enumerate(decoder_cases):
        layers = w.DECODER_CONFIGS[case["name"]].n_layers
        expected = counts(1 + 2 * layers + 2, 2 * layers + 1)
        for rank_out in outs:
            assert_counts(rank_out["decoders"][i], expected, f"{case['name']} tp{p}")


# --- in-process: operators at p = 1 and sizes that do not divide --------------------------------
def FakeComm(world_size: int, rank: int = 0) -> BaseComm:
    """Enough of a communicator to build layers: the transports' base class, which has no way
    to move bytes (construction sends nothing; a send would raise NotImplementedError)."""
    return BaseComm(rank=rank, world_size=world_size)


def test_operators_are_identities_on_one_rank():
    comm = FakeComm(1)
    x = torch.randn(3, 4, requires_grad=True)
    for op in (tp.copy_to_tensor_parallel, tp.reduce_from_tensor_parallel, tp.gather_from_tensor_parallel):
        y = op(x, comm)
        assert torch.equal(y, x)
        (g,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(g, torch.ones_like(x))
    assert tp.count_collectives(comm) == counts(0, 0)


@pytest.mark.parametrize(
    "build, numbers",
    [
        (lambda c: tp.ColumnParallelLinear(8, 10, c), ("10", "4")),
        (lambda c: tp.RowParallelLinear(6, 8, c), ("6", "4")),
        (lambda c: tp.ParallelMLP(8, 18, c), ("18", "4")),
        (lambda c: tp.ParallelSelfAttention(12, 6, c), ("n_heads", "6", "4")),
        (lambda c: tp.VocabParallelEmbedding(130, 8, c), ("130", "4")),
    ],
    ids=["column", "row", "mlp", "attention-heads", "vocab"],
)
def test_layers_name_sizes_that_do_not_divide(build, numbers):
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel degree") as info:
        build(FakeComm(4))
    for number in numbers:
        assert number in str(info.value)


@pytest.mark.parametrize(
    "change, numbers",
    [
        (dict(n_heads=6, hidden_size=48), ("n_heads = 6", "4")),
        (dict(vocab_size=130), ("vocab_size = 130", "4")),
        (dict(intermediate_size=130), ("130", "4")),
    ],
    ids=["heads", "vocab", "ffn"],
)
def test_decoder_names_sizes_that_do_not_divide(change, numbers):
    cfg = w.decoder_config()
    cfg = transformer.TransformerConfig(**{**cfg.__dict__, **change})
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel degree") as info:
        TensorParallelDecoderLM(cfg, FakeComm(4))
    for number in numbers:
        assert number in str(info.value)
    check_tp_config(cfg, 2)  # every size above divides by 2


def test_attention_refuses_a_bias_with_another_number_of_heads():
    attention = tp.ParallelSelfAttention(16, 4, FakeComm(2))
    with pytest.raises(ValueError, match="3 heads"):
        attention.local_bias(torch.zeros(1, 3, 5, 5))
    assert attention.local_bias(torch.zeros(2, 1, 5, 5)).shape == (2, 1, 5, 5)  # broadcasts as it is
    per_head = torch.arange(4.0)[None, :, None, None].expand(1, 4, 5, 5)
    assert torch.equal(attention.local_bias(per_head), per_head[:, :2])  # rank 0: heads 0 and 1


def test_load_dense_checks_shapes():
    layer = tp.ColumnParallelLinear(8, 16, FakeComm(2))
    with pytest.raises(ValueError, match=r"\(12, 8\)"):
        layer.load_dense(torch.zeros(12, 8), torch.zeros(12))


# --- CUDA ---------------------------------------------------------------------------------------
def test_decoder_equals_dense_model_on_cuda(module_case, decoder_cases):
    outs = md.launch(w.all_checks, 2, args=(module_case, decoder_cases), timeout=180, device="cuda")
    for i, case in enumerate(decoder_cases):
        model, out = dense_decoder(case)
        for r, rank_out in enumerate(outs):
            res = rank_out["decoders"][i]
            torch.testing.assert_close(res["loss"], out.loss.detach(), atol=1e-4, rtol=1e-3)
            torch.testing.assert_close(res["logits"], out.logits.detach(), atol=1e-4, rtol=1e-3)
            for name, q in model.named_parameters():
                torch.testing.assert_close(
                    res["grads"][name], expected_grad(name, q.grad, r, 2), atol=1e-4, rtol=1e-3
                )
            assert_counts(res, counts(1 + 2 * case_layers(case) + 2, 2 * case_layers(case) + 1), "cuda")


def case_layers(case) -> int:
    return w.DECODER_CONFIGS[case["name"]].n_layers
