"""Mixed precision: bf16 autocast vs fp32, DynamicLossScaler vs torch.amp.GradScaler, fp16 master weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from minidist.models.bert_experiments import bert_batches, bert_factory
from minidist.optim import DynamicLossScaler, amp

BF16_TOLERANCE = 0.02  # largest |loss_bf16 - loss_fp32| over the first steps of BERT tiny (loss ~9)
FP16_TOLERANCE = 0.05


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_bf16_autocast_loss_curve_stays_within_tolerance_of_fp32():
    batches = bert_batches(4, 16, 4, source="random")
    curves = amp.loss_curves(bert_factory("tiny"), batches, precisions=("fp32", "bf16"))
    gaps = [abs(a - b) for a, b in zip(curves["fp32"], curves["bf16"])]
    assert max(gaps) < BF16_TOLERANCE, gaps
    assert curves["fp32"] != curves["bf16"]  # autocast did change the arithmetic
    assert all(math.isfinite(x) for x in curves["bf16"])


def _linear(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(4, 3)


def _scaled_step(scaler_step, model, x, inject):
    """Backward of the scaled loss; ``inject`` = "inf"/"nan" puts one non-finite gradient entry."""
    loss = model(x).pow(2).mean()
    return scaler_step(loss, inject)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_overflow_skips_the_step_halves_the_scale_and_keeps_the_weights(bad):
    model = _linear()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale_loss(model(torch.randn(5, 4)).pow(2).mean()).backward()
    model.weight.grad[1, 2] = bad
    assert scaler.step(optimizer) is False
    assert scaler.scale == 512.0 and scaler.clean_steps == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert len(optimizer.state) == 0  # Adam's moments untouched too


def test_clean_steps_grow_the_scale_after_growth_interval():
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = DynamicLossScaler(init_scale=8.0, growth_factor=2.0, growth_interval=3)
    scales = []
    for _ in range(7):
        optimizer.zero_grad()
        scaler.scale_loss(model(torch.randn(5, 4)).pow(2).mean()).backward()
        assert scaler.step(optimizer) is True
        scales.append(scaler.scale)
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_unscaled_gradients_equal_the_plain_gradients():
    x = torch.randn(5, 4)
    plain, scaled = _linear(), _linear()
    plain(x).pow(2).mean().backward()
    scaler = DynamicLossScaler(init_scale=2.0**10)
    scaler.scale_loss(scaled(x).pow(2).mean()).backward()
    assert not torch.allclose(scaled.weight.grad, plain.weight.grad)  # scaled by 1024 before unscaling
    assert scaler.unscale_(scaled.parameters()) is False
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_scale_sequence_matches_torch_gradscaler():
    # overflow pattern: 1 = inject an inf into the gradient this step
    pattern = [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0]
    ours_model, torch_model = _linear(), _linear()
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.01)
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.01)
    ours = DynamicLossScaler(init_scale=256.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    reference = torch.amp.GradScaler(
        "cpu", init_scale=256.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3
    )
    gen = torch.Generator().manual_seed(0)
    ours_scales, torch_scales = [], []
    for overflow in pattern:
        x = torch.randn(5, 4, generator=gen)
        ours_opt.zero_grad()
        ours.scale_loss(ours_model(x).pow(2).mean()).backward()
        torch_opt.zero_grad()
        reference.scale(torch_model(x).pow(2).mean()).backward()
        if overflow:
            ours_model.bias.grad[0] = math.inf
            torch_model.bias.grad[0] = math.inf
        ours.step(ours_opt)
        reference.step(torch_opt)
        reference.update()
        ours_scales.append(ours.scale)
        torch_scales.append(reference.get_scale())
    assert ours_scales == torch_scales
    assert len(set(ours_scales)) > 2  # the pattern both shrank and grew the scale
    for a, b in zip(ours_model.parameters(), torch_model.parameters()):
        torch.testing.assert_close(a, b)


def test_fp16_master_weights_keep_updates_that_fp16_rounds_away():
    # weight 1.0, gradient 1, lr 1e-4: in fp16, 1 - 1e-4 rounds back to 1 (spacing below 1 is 2^-11)
    pure = nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        pure.weight.fill_(1.0)
    master_model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        master_model.weight.fill_(1.0)
    trainer = amp.Fp16MasterWeights(
        master_model, lambda m: torch.optim.SGD(m.parameters(), lr=1e-4), DynamicLossScaler(init_scale=8.0)
    )
    pure_opt = torch.optim.SGD(pure.parameters(), lr=1e-4)
    x = torch.ones(1, 1, dtype=torch.float16)
    for _ in range(10):
        pure_opt.zero_grad()
        pure(x).sum().backward()  # d/dw (w·1) = 1
        pure_opt.step()
        assert trainer.backward_and_step(trainer.model(x).sum())
    assert pure.weight.item() == 1.0  # every update lost
    assert trainer.master.weight.item() == pytest.approx(1.0 - 10e-4, abs=1e-6)  # fp32 rounding of 10 steps
    assert trainer.model.weight.dtype == torch.float16
    assert trainer.model.weight.item() == pytest.approx(0.999, abs=2.5e-4)  # fp16 copy of the master


def test_fp16_overflow_in_the_half_model_skips_the_master_step():
    trainer = amp.Fp16MasterWeights(
        _linear(), lambda m: torch.optim.Adam(m.parameters(), lr=0.1), DynamicLossScaler(init_scale=64.0)
    )
    before = [p.detach().clone() for p in trainer.master.parameters()]
    half_before = [p.detach().clone() for p in trainer.model.parameters()]
    handle = trainer.model.weight.register_hook(lambda g: torch.full_like(g, math.inf))  # an fp16 overflow
    x = torch.randn(5, 4).half()
    assert trainer.backward_and_step(trainer.model(x).pow(2).mean()) is False
    handle.remove()
    assert trainer.scaler.scale == 32.0
    assert all(torch.equal(p, b) for p, b in zip(trainer.master.parameters(), before))
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), half_before))
    assert all(p.grad is None for p in trainer.model.parameters())
    assert (
        trainer.backward_and_step(trainer.model(x).pow(2).mean()) is True
    )  # the next clean step goes through
    assert not torch.equal(trainer.master.weight, before[0])


def test_fp16_bert_loss_curve_stays_within_tolerance_of_fp32():
    batches = bert_batches(2, 16, 3, source="random")
    curves = amp.loss_curves(bert_factory("tiny"), batches, precisions=("fp32", "fp16"))
    gaps = [abs(a - b) for a, b in zip(curves["fp32"], curves["fp16"])]
    assert max(gaps) < FP16_TOLERANCE, gaps


def test_state_bytes_match_the_per_parameter_formula():
    from minidist.models import bert

    model = bert.BertForMLM(bert.CONFIGS["tiny"])
    n = bert.mlm_parameter_count(bert.CONFIGS["tiny"])
    steps = 4 * len(list(model.parameters()))  # AdamW keeps a 4-byte step counter per tensor
    measured = amp.state_bytes(bert_factory("tiny"), bert_batches(2, 16, 1, source="random")[0])
    for precision in ("fp32", "bf16 autocast"):  # autocast keeps weights, grads and moments in fp32
        assert measured[precision] == {
            "params": 4 * n,
            "grads": 4 * n,
            "optimizer": 8 * n + steps,
            "total": 16 * n + steps,
        }
    mixed = measured["fp16 + fp32 master"]  # fp16 model + fp32 master, both gradients, Adam on the master
    assert mixed == {"params": 6 * n, "grads": 6 * n, "optimizer": 8 * n + steps, "total": 20 * n + steps}


def test_cuda_fp16_master_weights_track_fp32_and_skip_overflows():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from minidist.models import bert

    batches = bert_batches(8, 32, 6, source="random")
    torch.manual_seed(0)
    fp32 = bert.BertForMLM(bert.CONFIGS["tiny"]).cuda()
    torch.manual_seed(0)
    trainer = amp.Fp16MasterWeights(
        bert.BertForMLM(bert.CONFIGS["tiny"]).cuda(),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        DynamicLossScaler(init_scale=2.0**12, growth_interval=2),
    )
    optimizer = torch.optim.AdamW(fp32.parameters(), lr=1e-3)
    for step, (ids, labels) in enumerate(batches):
        ids, labels = ids.cuda(), labels.cuda()
        loss32 = fp32(ids, labels=labels).loss
        optimizer.zero_grad()
        loss32.backward()
        optimizer.step()
        loss16 = trainer.model(ids, labels=labels).loss
        trainer.backward_and_step(loss16)
        assert abs(loss16.item() - loss32.item()) < FP16_TOLERANCE, step
    assert trainer.model.transformer.embeddings.word.weight.dtype == torch.float16
    assert trainer.master.transformer.embeddings.word.weight.dtype == torch.float32
    # an injected overflow on the GPU: step skipped, scale halved, master weights unchanged
    scale = trainer.scaler.scale
    before = trainer.master.transformer.embeddings.word.weight.detach().clone()
    weight = trainer.model.transformer.embeddings.word.weight
    handle = weight.register_hook(lambda g: torch.full_like(g, math.inf))
    ids, labels = batches[0]
    stepped = trainer.backward_and_step(trainer.model(ids.cuda(), labels=labels.cuda()).loss)
    handle.remove()
    assert stepped is False and trainer.scaler.scale == scale / 2
    assert torch.equal(trainer.master.transformer.embeddings.word.weight, before)
