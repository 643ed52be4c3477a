"""Megatron sequence parallelism (``minidist.parallel.tensor.sequence``, ``TensorParallelDecoderLM(...,
sequence_parallel=True)``) against one process, against tensor parallelism without it, and
against formulas for bytes and saved activations.

One ``md.launch`` per world size t in {2, 3, 4} (transport "pipe", so every collective moves
counted bytes: the shm transport's allreduce sends none) runs every case in three variants --
TP, TP+SP, TP+SP with ``keep_gathered`` -- (``sp_workers.all_checks``); the tests read it.
Reference: ``DecoderLM`` run here on the same weights and tokens, fp32, ``atol=1e-5, rtol=1e-4``.

Bytes (payload one rank sends), n = b·s·h·4 the bytes of one (B, S, h) fp32 activation:
    all-gather or reduce-scatter of n:  AG(n) = RS(n) = (t-1)/t · n     (ring)
    allreduce of m:                     AR(m) = 2 (t-1)/t · m = RS(m) + AG(m)  (ring; butterfly at t=4
                                        sends the same here, every size dividing by t)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minidist as md
import sp_workers as w
from minidist.collectives import cost_model
from minidist.memory.activations import activation_bytes_per_layer, block_activation_bytes
from minidist.models import decoder
from minidist.models.tp_decoder import TensorParallelDecoderLM
from minidist.parallel import tensor as tp
from minidist.transport.base import BaseComm

pytestmark = pytest.mark.timeout(180)

ATOL, RTOL = 1e-5, 1e-4
WORLD_SIZES = (2, 3, 4)
SP_VARIANTS = ("sp", "sp_keep_gathered")
E = 4  # fp32 bytes an element


def close(got, want, what=""):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module")
def decoder_cases():
    return [w.decoder_case(name, seed=5) for name in w.DECODER_CONFIGS]


@pytest.fixture(scope="module")
def dense_runs(decoder_cases):
    """The one-process reference for each case: (loss, logits, {name: grad})."""
    runs = []
    for case in decoder_cases:
        model = decoder.DecoderLM(w.DECODER_CONFIGS[case["name"]])
        model.load_state_dict(case["state"])
        out = model(case["ids"], labels=case["labels"], attention_mask=case["mask"])
        out.loss.backward()
        runs.append(
            (out.loss.detach(), out.logits.detach(), {n: q.grad for n, q in model.named_parameters()})
        )
    return runs


@pytest.fixture(scope="module")
def block_case():
    return w.block_case(seed=7)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda t: f"t{t}")
def run(request, decoder_cases, block_case):
    t = request.param
    outs = md.launch(
        w.all_checks, t, args=(decoder_cases, block_case), timeout=120, transport="pipe", threads_per_worker=1
    )
    return t, outs


def ag(n_bytes: int, t: int) -> float:
    return (t - 1) * n_bytes / t


def ar(n_bytes: int, t: int) -> float:
    return 2 * (t - 1) * n_bytes / t


def ar_exact(numel: int, t: int, rank: int) -> int:
    """The loss's allreduces of b(s-1) = 22 numbers do not split evenly over t = 3: the cost model's
    exact count for the algorithm ``auto`` picks on the pipe transport."""
    algorithm = cost_model.fastest_allreduce(t, numel * E, cost_model.DEFAULTS["pipe"])
    return cost_model.bytes_sent(algorithm, t, rank, numel, E)


# --- the decoder: equal to one process and to TP without SP --------------------------------------
SPLIT_ROWS = ("query.", "key.", "value.", "up.", "word.")
SPLIT_COLUMNS = ("output.weight", "down.weight")


def expected_grad(name: str, dense_grad: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    if any(key in name for key in SPLIT_COLUMNS):
        return dense_grad.chunk(t, dim=1)[rank]
    if any(key in name for key in SPLIT_ROWS):
        return dense_grad.chunk(t, dim=0)[rank]
    return dense_grad  # replicated: LayerNorms, positions, row-parallel biases -- summed over the ranks


def test_decoder_equals_dense_model_and_tp(run, decoder_cases, dense_runs):
    t, outs = run
    for i, (case, (loss, logits, grads)) in enumerate(zip(decoder_cases, dense_runs, strict=True)):
        for r, rank_out in enumerate(outs):
            tp_res = rank_out["decoders"][i]["tp"]
            for variant in SP_VARIANTS:
                res = rank_out["decoders"][i][variant]
                what = f"{case['name']} {variant} t{t} rank {r}"
                close(res["loss"], loss, f"{what} loss")
                close(res["loss"], tp_res["loss"], f"{what} loss vs TP")
                close(res["logits"], logits, f"{what} logits")
                assert res["grads"].keys() == grads.keys(), f"{what}: parameter names differ from DecoderLM's"
                for name, g in grads.items():
                    close(res["grads"][name], expected_grad(name, g, r, t), f"{what} grad {name}")
                    close(res["grads"][name], tp_res["grads"][name], f"{what} grad {name} vs TP")


def test_decoder_collective_counts(run, decoder_cases):
    # TP:  forward 1 (embedding g) + 2L (g) + 2 (loss) allreduces; backward 2L (f) + 1 (f before the logits)
    # SP:  each g becomes a reduce-scatter forward + an all-gather backward, each f an all-gather forward +
    #      a reduce-scatter backward; backward also: a re-gather per g-bar (2L + 1, not with keep_gathered),
    #      the position table's rows (1 all-gather, learned positions), and one allreduce per LayerNorm
    #      (2L + 1 + embedding LN) and per row-parallel bias (2L): replicated parameters used on S/t tokens
    t, outs = run
    for i, case in enumerate(decoder_cases):
        cfg = w.DECODER_CONFIGS[case["name"]]
        L, positions, emb_ln = cfg.n_layers, int(cfg.position == "learned"), int(cfg.embedding_layernorm)
        want = {
            "tp": {
                "forward": {"allreduce": 1 + 2 * L + 2, "allgather": 0, "reduce_scatter": 0},
                "backward": {"allreduce": 2 * L + 1, "allgather": 0, "reduce_scatter": 0},
            },
        }
        for variant, regathers in (("sp", 2 * L + 1), ("sp_keep_gathered", 0)):
            want[variant] = {
                "forward": {"allreduce": 2, "allgather": 2 * L + 1, "reduce_scatter": 1 + 2 * L},
                "backward": {
                    "allreduce": (2 * L + 1 + emb_ln) + 2 * L,
                    "allgather": 1 + 2 * L + regathers + positions,
                    "reduce_scatter": 2 * L + 1,
                },
            }
        for r, rank_out in enumerate(outs):
            for variant, expected in want.items():
                got = rank_out["decoders"][i][variant]["counts"]
                assert got == expected, f"{case['name']} {variant} t{t} rank {r}: {got}"


def test_decoder_bytes_equal_formula(run, decoder_cases):
    # forward: SP sends exactly TP's bytes (RS + AG for every allreduce). Backward: TP's bytes plus
    # the re-gathers AG(n) (2L + 1), the position rows AG(s·h·4), and the small allreduces
    # AR(2h·4) per LayerNorm, AR(h·4) per row-parallel bias.
    t, outs = run
    b, s, h = w.BATCH, w.SEQ, w.D
    n = b * s * h * E
    for i, case in enumerate(decoder_cases):
        cfg = w.DECODER_CONFIGS[case["name"]]
        L = cfg.n_layers
        tokens = b * (s - 1)
        tp_backward = ar(n, t) * (2 * L + 1)
        small = (2 * L + 1 + cfg.embedding_layernorm) * ar(2 * h * E, t) + 2 * L * ar(h * E, t)
        positions = ag(s * h * E, t) if cfg.position == "learned" else 0
        for r, rank_out in enumerate(outs):
            tp_forward = ar(n, t) * (1 + 2 * L) + ar_exact(tokens, t, r) + ar_exact(2 * tokens, t, r)
            want = {
                "tp": (tp_forward, tp_backward),
                "sp": (tp_forward, tp_backward + (2 * L + 1) * ag(n, t) + positions + small),
                "sp_keep_gathered": (tp_forward, tp_backward + positions + small),
            }
            for variant, (forward, backward) in want.items():
                got = rank_out["decoders"][i][variant]["bytes"]
                assert got == {"forward": forward, "backward": backward}, (
                    f"{case['name']} {variant} t{t} r{r}"
                )


# --- one block: bytes and saved activations -------------------------------------------------------
def test_block_bytes_equal_formula(run):
    # TP: 2 allreduces of n forward (g), 2 backward (f):        2 AR(n) = 4 (t-1)/t n each way
    # SP: 2 AG(n) + 2 RS(n) forward = TP's forward, exactly; backward 2 RS(n) + 2 AG(n) (= TP's backward)
    #     + 2 AG(n) re-gathers (not with keep_gathered) + AR(2h·4) per LayerNorm + AR(h·4) per bias
    t, outs = run
    n = w.BATCH * w.SEQ * w.D * E
    tp_phase = 2 * ar(n, t)
    small = 2 * ar(2 * w.D * E, t) + 2 * ar(w.D * E, t)
    want = {
        "tp": {"forward": tp_phase, "backward": tp_phase},
        "sp": {"forward": tp_phase, "backward": tp_phase + 2 * ag(n, t) + small},
        "sp_keep_gathered": {"forward": tp_phase, "backward": tp_phase + small},
    }
    for r, rank_out in enumerate(outs):
        for variant, expected in want.items():
            block = rank_out["block"][variant]
            assert block["bytes"] == expected, f"block {variant} t{t} rank {r}: {block['bytes']}"
        assert rank_out["block"]["sp"]["counts"] == {
            "forward": {"allreduce": 0, "allgather": 2, "reduce_scatter": 2},
            "backward": {"allreduce": 4, "allgather": 4, "reduce_scatter": 2},
        }


def test_block_outputs_agree(run, block_case):
    # the block alone, TP+SP against TP: the output and the input's gradient, token shard by shard
    t, outs = run
    for r, rank_out in enumerate(outs):
        full = rank_out["block"]["tp"]
        for variant in SP_VARIANTS:
            mine = rank_out["block"][variant]
            close(mine["y"], full["y"].chunk(t, dim=1)[r], f"block {variant} t{t} rank {r} output")
            close(mine["gx"], full["gx"].chunk(t, dim=1)[r], f"block {variant} t{t} rank {r} input grad")


def dropout_bytes(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool) -> float:
    """The terms of Korthikanti et al.'s per-layer count that a dropout-free block does not have
    (16-bit model): the two masks after the sub-blocks (1 byte a token-feature, whole under TP,
    split by SP), the attention weights' mask (as²b/t) and the dropout's output (2as²b/t)."""
    masks = 2 * s * b * h / (t if sequence_parallel else 1)
    return masks + 3 * a * s * s * b / t


def test_block_saved_activations_match_the_calculator(run):
    # The calculator (memory.activations.activation_bytes_per_layer) counts 16-bit activations with
    # dropout: sbh (10 + 24/t + 5as/(ht)) under TP, sbh/t (34 + 5as/h) with SP. Our block has no dropout
    # and runs in fp32, so: measured = 2 x (calculator - dropout terms) + the LayerNorms' mean and 1/std
    # (2 LayerNorms x 2 x sb x 4 bytes, which the paper leaves out; split by SP).
    t, outs = run
    s, b, h, a = w.SEQ, w.BATCH, w.D, w.HEADS
    stats = 2 * 2 * s * b * 4
    paper = {sp: activation_bytes_per_layer(s, b, h, a, tp=t, sequence_parallel=sp) for sp in (False, True)}
    want_tp = 2 * (paper[False] - dropout_bytes(s, b, h, a, t, False)) + stats
    want_sp = 2 * (paper[True] - dropout_bytes(s, b, h, a, t, True)) + stats / t
    for r, rank_out in enumerate(outs):
        measured = {v: rank_out["block"][v]["saved_bytes"] for v in w.VARIANTS}
        assert measured["tp"] == want_tp, f"t{t} rank {r}: TP saved {measured['tp']}, formula {want_tp}"
        assert measured["sp"] == want_sp, f"t{t} rank {r}: SP saved {measured['sp']}, formula {want_sp}"
        # everything divided by t: the exact count for the one-process block, over t
        assert measured["sp"] * t == block_activation_bytes(s, b, h, a, element_size=E)
        # keep_gathered keeps the two gathered inputs (Q/K/V's and up's) whole: 2·e·sbh (1 - 1/t) more
        assert measured["sp_keep_gathered"] - measured["sp"] == 2 * E * s * b * h * (t - 1) / t


# --- in-process: one rank, sizes that do not divide ------------------------------------------------
def FakeComm(world_size: int, rank: int = 0) -> BaseComm:
    """A communicator that cannot move bytes (construction and the checks before any send only)."""
    return BaseComm(rank=rank, world_size=world_size)


def test_operators_are_identities_on_one_rank():
    comm = FakeComm(1)
    x = torch.randn(2, 6, 4, requires_grad=True)
    for op in (
        tp.gather_from_sequence_parallel,
        tp.reduce_scatter_to_sequence_parallel,
        tp.scatter_to_sequence_parallel,
    ):
        y = op(x, comm)
        assert torch.equal(y, x)
        (g,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(g, torch.ones_like(x))
    assert tp.count_sequence_collectives(comm) == {
        phase: {"allgather": 0, "reduce_scatter": 0} for phase in ("forward", "backward")
    }


def test_gather_and_linear_backward_equals_torch_on_one_rank():
    # the fused function's own backward (dx, dW, db from the re-gathered input) against autograd's F.linear
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    layers = [(torch.randn(6, 8), torch.randn(6)), (torch.randn(3, 8), None)]
    grads_out = [torch.randn(2, 5, 6), torch.randn(2, 5, 3)]

    def run(fn):
        xs = x.clone().requires_grad_(True)
        params = [(wt.clone().requires_grad_(True), None if bi is None else bi.clone().requires_grad_(True))
                  for wt, bi in layers]  # fmt: skip
        ys = fn(xs, params)
        sum((y * g).sum() for y, g in zip(ys, grads_out, strict=True)).backward()
        return ys, xs.grad, [(wt.grad, None if bi is None else bi.grad) for wt, bi in params]

    ours = run(lambda xs, params: tp.gather_and_linear(xs, params, FakeComm(1)))
    torch_ = run(lambda xs, params: [F.linear(xs, wt, bi) for wt, bi in params])
    for y, want in zip(ours[0], torch_[0], strict=True):
        close(y.detach(), want.detach(), "output")
    close(ours[1], torch_[1], "input grad")
    for (gw, gb), (want_w, want_b) in zip(ours[2], torch_[2], strict=True):
        close(gw, want_w, "weight grad")
        assert (gb is None) == (want_b is None)
        if gb is not None:
            close(gb, want_b, "bias grad")


def test_sequence_length_must_divide_by_the_degree():
    model = TensorParallelDecoderLM(w.decoder_config(), FakeComm(4), sequence_parallel=True)
    ids = torch.zeros(1, 10, dtype=torch.long)
    with pytest.raises(
        ValueError, match="sequence length 10 is not divisible by the tensor-parallel degree 4"
    ):
        model(ids)
    with pytest.raises(ValueError, match="pad the sequence to a multiple of 4"):
        tp.scatter_to_sequence_parallel(torch.zeros(1, 10, 3), FakeComm(4))
    assert tp.check_sequence_divisible(12, FakeComm(4)) == 3


def test_layer_norm_loads_a_dense_state():
    dense = torch.nn.LayerNorm(8)
    with torch.no_grad():
        dense.weight.uniform_()
        dense.bias.uniform_()
    ours = tp.SequenceParallelLayerNorm(8, FakeComm(1))
    ours.load_state_dict(dense.state_dict())
    x = torch.randn(2, 3, 8)
    close(ours(x), dense(x), "SequenceParallelLayerNorm on one rank")
