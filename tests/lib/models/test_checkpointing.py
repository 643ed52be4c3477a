"""Activation checkpointing (minidist.models.checkpointing): same numbers, fewer saved bytes.

References: the un-checkpointed computation, ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``,
and the byte counts that follow from which tensors each mode keeps (fp32, 4 bytes per value).
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from minidist import memory
from minidist.models import checkpointing as ck
from minidist.models.bert import BertForMLM
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig
from tiny import tiny_config

VOCAB, HIDDEN, HEADS, BATCH = 64, 32, 4, 2


def config(causal: bool, n_layers: int = 2, dropout: float = 0.0) -> TransformerConfig:
    return tiny_config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        n_layers=n_layers,
        n_heads=HEADS,
        causal=causal,
        pre_ln=causal,
        dropout=dropout,
    )


def build(causal: bool, n_layers: int = 2, dropout: float = 0.0, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = config(causal, n_layers, dropout)
    return DecoderLM(cfg) if causal else BertForMLM(cfg)


def ids(seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: nn.Module, input_ids: torch.Tensor, seed: int = 5):
    torch.manual_seed(seed)  # the same dropout draws for every mode
    model.zero_grad(set_to_none=True)
    loss = model(input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def saved(model: nn.Module, input_ids: torch.Tensor) -> int:
    return memory.saved_activation_bytes(lambda x: model(x, labels=x).loss, input_ids)


class Piece(nn.Module):
    """A small function with weights, a non-linearity and (optionally) dropout, to checkpoint."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.up, self.down, self.dropout = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.down(self.dropout(torch.tanh(self.up(x)))) * scale


# -- checkpoint(fn, *args) --------------------------------------------------------------------


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_checkpoint_matches_torch_and_no_checkpoint(dropout):
    torch.manual_seed(0)
    piece = Piece(dropout)
    x0 = torch.randn(4, 8)
    variants = {
        "plain": lambda x: piece(x, 2.0),
        "ours": lambda x: ck.checkpoint(piece, x, 2.0),
        "torch": lambda x: torch_checkpoint.checkpoint(piece, x, 2.0, use_reentrant=False),
    }
    results = {}
    for name, run in variants.items():
        piece.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        torch.manual_seed(7)
        out = run(x)
        out.square().sum().backward()
        after = torch.rand(3)  # the generator must have moved on exactly as without recompute
        results[name] = (out.detach(), x.grad, [p.grad for p in piece.parameters()], after)
    for name in ("ours", "torch"):
        out, dx, dws, after = results[name]
        assert torch.equal(out, results["plain"][0]), name
        assert torch.equal(dx, results["plain"][1]), name
        for dw, ref in zip(dws, results["plain"][2], strict=True):
            assert torch.equal(dw, ref), name
        assert torch.equal(after, results["plain"][3]), name
    if dropout:  # the test can tell a wrong mask: two different seeds give different outputs
        torch.manual_seed(8)
        assert not torch.equal(piece(x0, 2.0), results["plain"][0])


def test_checkpoint_saves_only_inputs_and_recomputes():
    calls = []

    def fn(x, w):
        calls.append(1)
        return torch.tanh(x @ w).exp()  # tanh and exp each save their output: 2 tensors

    x = torch.randn(16, 32, requires_grad=True) * 1.0  # an activation (not a leaf)
    w = torch.randn(32, 32, requires_grad=True)  # a weight: a leaf, never counted
    plain = memory.saved_activation_bytes(fn, x, w)
    kept = memory.saved_activation_bytes(lambda a, b: ck.checkpoint(fn, a, b), x, w)
    assert plain == 3 * 16 * 32 * 4  # x (for the matmul), tanh's and exp's outputs
    assert kept == x.numel() * 4  # x only, nothing from inside
    assert plain > kept
    calls.clear()
    ck.checkpoint(fn, x, w).sum().backward()
    assert len(calls) == 2  # once forward, once in backward
    with torch.no_grad():
        calls.clear()
        ck.checkpoint(fn, x, w)
        assert len(calls) == 1


def test_checkpoint_gives_weight_grads_when_no_input_requires_grad():
    torch.manual_seed(0)
    piece = Piece(0.0)
    x = torch.randn(4, 8)  # no grad: only the weights inside learn
    ck.checkpoint(piece, x, 1.0).sum().backward()
    got = [p.grad.clone() for p in piece.parameters()]
    piece.zero_grad(set_to_none=True)
    piece(x, 1.0).sum().backward()
    for g, ref in zip(got, piece.parameters(), strict=True):
        assert torch.equal(g, ref.grad)


# -- apply_checkpointing on the course models -------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "bert"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_modes_give_the_same_loss_and_grads(causal, dropout):
    model = build(causal, dropout=dropout)
    model.train()
    x = ids(12)
    keys = list(model.state_dict())
    reference = loss_and_grads(model, x)
    for mode in ("selective", "full", "none"):
        ck.apply_checkpointing(model, mode)
        assert ck.checkpointing_mode(model) == mode
        loss, grads = loss_and_grads(model, x)
        assert torch.equal(loss, reference[0]), mode
        for name, g in grads.items():
            assert torch.equal(g, reference[1][name]), (mode, name)
    assert list(model.state_dict()) == keys  # the parameters were never moved or renamed


def test_remove_checkpointing_restores_the_saved_bytes():
    model = build(causal=True)
    x = ids(8)
    before = saved(model, x)
    ck.apply_checkpointing(model, "full")
    assert saved(model, x) < before
    ck.remove_checkpointing(model)
    assert ck.checkpointing_mode(model) == "none"
    assert saved(model, x) == before
    ck.apply_checkpointing(model, "selective")
    ck.apply_checkpointing(model, "full")  # switching modes replaces, never stacks
    full_only = saved(model, x)
    ck.apply_checkpointing(model, "none")
    ck.apply_checkpointing(model, "full")
    assert saved(model, x) == full_only


def per_layer_bytes(causal: bool, mode: str, seq: int) -> int:
    """Saved bytes of a 2-layer model minus those of a 1-layer one: what one layer keeps."""
    x = ids(seq)
    two, one = (ck.apply_checkpointing(build(causal, n), mode) for n in (2, 1))
    return saved(two, x) - saved(one, x)


@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "bert"])
def test_saved_bytes_follow_the_formula(causal):
    """full: a layer keeps its input, s·b·h values; selective drops exactly the a·s²·b softmax output.

    (In fp32 and with dropout 0, the s² tensors autograd keeps per layer are the softmax output,
    a·s²·b values; Korthikanti et al.'s 5·a·s²·b bytes count 16-bit scores, softmax and a dropout mask.)
    """
    for seq in (8, 16):
        sbh = seq * BATCH * HIDDEN * 4
        as2b = HEADS * seq * seq * BATCH * 4
        none = per_layer_bytes(causal, "none", seq)
        selective = per_layer_bytes(causal, "selective", seq)
        full = per_layer_bytes(causal, "full", seq)
        assert full == sbh
        assert none - selective == as2b
        assert none > selective > full
    # Linear in s for selective (up to the per-layer constant 0), more than linear without it.
    assert per_layer_bytes(causal, "selective", 16) == 2 * per_layer_bytes(causal, "selective", 8)
    assert per_layer_bytes(causal, "none", 16) > 2 * per_layer_bytes(causal, "none", 8)


def test_measure_checkpointing_orders_the_modes():
    cfg = config(causal=True)
    result = ck.measure_checkpointing(cfg, batch=BATCH, seq=16, repeats=1)
    assert set(result) == set(ck.MODES)
    b = {mode: result[mode]["saved_bytes"] for mode in ck.MODES}
    assert b["none"] > b["selective"] > b["full"]
    model = DecoderLM(cfg)
    assert b["none"] == saved(model, ids(16, seed=0))  # the same count as measured directly
    assert all(result[mode]["step_s"] > 0 for mode in ck.MODES)


def test_bad_input():
    with pytest.raises(ValueError, match="mode must be one of"):
        ck.apply_checkpointing(build(causal=True), "some")
    with pytest.raises(ValueError, match="no TransformerBlock"):
        ck.apply_checkpointing(nn.Linear(2, 2), "full")


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_on_cuda(mode):
    model = build(causal=True, dropout=0.1).cuda()
    x = ids(16).cuda()

    def run():
        torch.cuda.manual_seed(3)
        return loss_and_grads(model, x)

    reference = run()
    ck.apply_checkpointing(model, mode)
    loss, grads = run()
    # Close, not equal: CUDA kernels (embedding backward's atomic adds) may sum in another order.
    # A wrong dropout mask would change the grads at the first digit.
    torch.testing.assert_close(loss, reference[0], rtol=1e-6, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, reference[1][name], rtol=1e-5, atol=1e-6, msg=name)
