"""minidist.optim: schedules against their formulas, LARS and LAMB against hand-written reference steps."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from minidist.optim import (
    LAMB,
    LARS,
    linear_scaled_lr,
    param_groups,
    scaled_lr,
    sqrt_scaled_lr,
    warmup_decay_factor,
    warmup_decay_schedule,
    warmup_lr,
)


# --- schedules ---------------------------------------------------------------------------------
def test_scaling_rules_follow_the_formulas():
    assert linear_scaled_lr(0.1, 8192, 256) == pytest.approx(0.1 * 32)
    assert sqrt_scaled_lr(1e-3, 4096, 256) == pytest.approx(1e-3 * 4)
    assert scaled_lr(1e-3, 64, 16, "sqrt") == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 64, 16, "none") == 1e-3
    with pytest.raises(ValueError, match="scaling rule"):
        scaled_lr(1e-3, 64, 16, "cubic")
    with pytest.raises(ValueError, match="batch sizes"):
        linear_scaled_lr(0.1, 0, 256)


def test_goyal_warmup_ramps_linearly_from_base_to_scaled_lr():
    base, k, warmup = 0.1, 8, 5
    lrs = [warmup_lr(t, base * k, warmup, start_lr=base) for t in range(8)]
    step = (base * k - base) / warmup  # the same increment every step
    for t in range(warmup):
        assert lrs[t] == pytest.approx(base + t * step)
    assert lrs[warmup:] == [pytest.approx(base * k)] * 3
    assert warmup_lr(3, 1.0, 0) == 1.0  # no warm-up


@pytest.mark.parametrize("decay", ["linear", "cosine", "none"])
def test_warmup_decay_schedule_drives_lambdalr(decay):
    peak, warmup, total, final = 2e-3, 4, 12, 0.1
    w = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=peak)
    sched = warmup_decay_schedule(opt, warmup, total, decay, start_factor=0.0, final_factor=final)
    seen = []
    for _ in range(total + 2):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    for t, lr in enumerate(seen):
        if t < warmup:
            expected = t / warmup
        elif decay == "none":
            expected = 1.0
        else:
            progress = min(1.0, (t - warmup) / (total - warmup))
            if decay == "linear":
                expected = 1 - (1 - final) * progress
            else:
                expected = final + (1 - final) * (1 + math.cos(math.pi * progress)) / 2
        assert lr == pytest.approx(peak * expected), t
    with pytest.raises(ValueError, match="warmup_steps"):
        warmup_decay_factor(0, 10, 5)


# --- parameter groups --------------------------------------------------------------------------
class _Net(nn.Module):
    """Linear + LayerNorm + Linear: two matrices, four vectors."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.second = nn.Linear(3, 2)

    def forward(self, x):
        return self.second(torch.tanh(self.norm(self.first(x))))


def _net(seed=0):
    torch.manual_seed(seed)
    net = _Net()
    with torch.no_grad():  # LayerNorm starts at (1, 0); move it so its update is not trivial
        net.norm.weight.add_(torch.randn(3) * 0.1)
        net.norm.bias.add_(torch.randn(3) * 0.1)
    return net


def test_param_groups_exclude_biases_and_layernorm():
    groups = param_groups(_net(), weight_decay=0.01)
    assert groups[0]["names"] == ["first.weight", "second.weight"]
    assert groups[0]["weight_decay"] == 0.01 and groups[0]["trust_ratio"] is True
    assert groups[1]["names"] == ["first.bias", "norm.weight", "norm.bias", "second.bias"]
    assert groups[1]["weight_decay"] == 0.0 and groups[1]["trust_ratio"] is False


def test_param_groups_of_bert_hold_each_parameter_once():
    from minidist.models import bert

    model = bert.BertForMLM(bert.CONFIGS["tiny"])
    groups = param_groups(model, 0.01)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # tied embedding once
    assert all(p.dim() < 2 for p in groups[1]["params"])
    assert all(p.dim() == 2 for p in groups[0]["params"])
    assert "transformer.embeddings.word.weight" in groups[0]["names"]
    assert any("norm" in n for n in groups[1]["names"]) and "head_bias" in groups[1]["names"]


# --- independent reference steps (plain Python floats, element by element) ----------------------
def _norm(values):
    return math.sqrt(sum(v * v for v in values))


def _reference_lamb(weights, grads_per_step, flags, lr, betas, eps, wd):
    """LAMB (You et al. 2019, Alg. 2) on lists of floats; flags[i]: (decay and trust ratio) for tensor i."""
    beta1, beta2 = betas
    w = [list(x) for x in weights]
    m = [[0.0] * len(x) for x in w]
    v = [[0.0] * len(x) for x in w]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            adapted = flags[i]
            r = []
            for j, gj in enumerate(g):
                m[i][j] = beta1 * m[i][j] + (1 - beta1) * gj
                v[i][j] = beta2 * v[i][j] + (1 - beta2) * gj * gj
                m_hat = m[i][j] / (1 - beta1**t)
                v_hat = v[i][j] / (1 - beta2**t)
                r.append(m_hat / (math.sqrt(v_hat) + eps) + (wd * w[i][j] if adapted else 0.0))
            trust = 1.0
            if adapted and _norm(w[i]) > 0 and _norm(r) > 0:
                trust = _norm(w[i]) / _norm(r)
            w[i] = [wj - lr * trust * rj for wj, rj in zip(w[i], r)]
    return w


def _reference_lars(weights, grads_per_step, flags, lr, momentum, wd, eta):
    w = [list(x) for x in weights]
    buf = [None] * len(w)
    for grads in grads_per_step:
        for i, g in enumerate(grads):
            adapted = flags[i]
            u = [gj + (wd * wj if adapted else 0.0) for gj, wj in zip(g, w[i])]
            trust = 1.0
            if adapted and _norm(w[i]) > 0 and _norm(u) > 0:
                trust = eta * _norm(w[i]) / _norm(u)
            u = [trust * x for x in u]
            buf[i] = u if buf[i] is None else [momentum * b + x for b, x in zip(buf[i], u)]
            w[i] = [wj - lr * bj for wj, bj in zip(w[i], buf[i])]
    return w


def _run(optimizer_factory, net, grads_per_step):
    opt = optimizer_factory(param_groups(net, weight_decay=0.05))
    params = [p for g in opt.param_groups for p in g["params"]]
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return params


def _gradient_sequence(params, steps=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(p.shape, generator=gen) * (0.1 + i) for i, p in enumerate(params)] for _ in range(steps)
    ]


def _flat(tensors):
    return [t.detach().flatten().tolist() for t in tensors]


def _ordered(net):
    groups = param_groups(net, 0.05)
    params = [p for g in groups for p in g["params"]]
    flags = [g["trust_ratio"] for g in groups for _ in g["params"]]
    return params, flags


@pytest.mark.parametrize("zero_weight", [False, True])
def test_lamb_matches_reference_steps(zero_weight):
    net = _net()
    if zero_weight:  # ||w|| = 0: trust ratio 1 by convention
        with torch.no_grad():
            net.second.weight.zero_()
    params, flags = _ordered(net)
    grads = _gradient_sequence(params)
    expected = _reference_lamb(
        _flat(params), [_flat(g) for g in grads], flags, 0.01, (0.9, 0.999), 1e-6, 0.05
    )
    got = _run(lambda groups: LAMB(groups, lr=0.01, betas=(0.9, 0.999), eps=1e-6), net, grads)
    for p, e in zip(got, expected):
        torch.testing.assert_close(p.detach().flatten(), torch.tensor(e), rtol=1e-5, atol=1e-6)
    # and it moved every tensor (a reference that ignored some tensors would not catch it otherwise)
    assert all(
        not torch.equal(p.detach().flatten(), torch.tensor(w))
        for p, w in zip(got, _flat(_ordered(_net())[0]))
    )


@pytest.mark.parametrize("zero_weight", [False, True])
def test_lars_matches_reference_steps(zero_weight):
    net = _net()
    if zero_weight:
        with torch.no_grad():
            net.first.weight.zero_()
    params, flags = _ordered(net)
    grads = _gradient_sequence(params, seed=2)
    expected = _reference_lars(_flat(params), [_flat(g) for g in grads], flags, 0.5, 0.9, 0.05, 0.02)
    got = _run(lambda groups: LARS(groups, lr=0.5, momentum=0.9, trust_coefficient=0.02), net, grads)
    for p, e in zip(got, expected):
        torch.testing.assert_close(p.detach().flatten(), torch.tensor(e), rtol=1e-5, atol=1e-6)


def test_lamb_without_trust_ratio_and_decay_is_adam():
    net_a, net_b = _net(), _net()
    opt_a = LAMB(net_a.parameters(), lr=0.01, eps=1e-6, trust_ratio=False)
    opt_b = torch.optim.Adam(net_b.parameters(), lr=0.01, eps=1e-6)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    for _ in range(5):
        for net, opt in ((net_a, opt_a), (net_b, opt_b)):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    for a, b in zip(net_a.parameters(), net_b.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert not torch.equal(net_a.first.weight, _net().first.weight)


def test_lars_without_trust_ratio_is_sgd_momentum():
    net_a, net_b = _net(), _net()
    opt_a = LARS(net_a.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, trust_ratio=False)
    opt_b = torch.optim.SGD(net_b.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    for _ in range(5):
        for net, opt in ((net_a, opt_a), (net_b, opt_b)):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    for a, b in zip(net_a.parameters(), net_b.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_lamb_step_moves_each_adapted_tensor_by_lr_times_its_norm():
    # the defining property: ||Δw|| = lr · ||w|| for every trust-ratio tensor, whatever the gradient scale
    net = _net()
    params, flags = _ordered(net)
    before = [p.detach().clone() for p in params]
    grads = [[g * 1000.0 for g in gs] for gs in _gradient_sequence(params, steps=1)]
    _run(lambda groups: LAMB(groups, lr=0.01), net, grads)
    for p, b, adapted in zip(params, before, flags):
        if adapted:
            assert torch.linalg.vector_norm(p.detach() - b).item() == pytest.approx(
                0.01 * b.norm().item(), rel=1e-4
            )


def test_bad_hyperparameters_are_refused():
    w = [nn.Parameter(torch.ones(2, 2))]
    with pytest.raises(ValueError, match="betas"):
        LAMB(w, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="momentum"):
        LARS(w, momentum=1.5)
    with pytest.raises(ValueError, match="weight_decay"):
        param_groups(nn.Linear(2, 2), -1.0)


# --- the large-batch experiment -----------------------------------------------------------------
from minidist.optim import large_batch as lb  # noqa: E402

SMALL = lb.LargeBatchConfig(base_batch=8, multipliers=(1, 4), samples=256, micro_batch=16, eval_points=4)


def test_accumulated_gradient_equals_one_big_batch():
    problem = lb.make_problem(SMALL)
    x, y = problem.train_x[:96], problem.train_y[:96]
    whole, pieces = lb.make_model(SMALL), lb.make_model(SMALL)
    loss_whole = lb.accumulate_gradients(whole, x, y, micro_batch=96)  # one backward
    loss_pieces = lb.accumulate_gradients(pieces, x, y, micro_batch=20)  # 20+20+20+20+16: unequal pieces
    assert loss_pieces == pytest.approx(loss_whole, rel=1e-6)
    for a, b in zip(whole.parameters(), pieces.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    unweighted = lb.make_model(SMALL)  # what forgetting the N_i/N weights would give: k times too large
    for start in range(0, 96, 24):
        nn.functional.cross_entropy(unweighted(x[start : start + 24]), y[start : start + 24]).backward()
    assert not torch.allclose(unweighted[0].weight.grad, whole[0].weight.grad)


@pytest.mark.timeout(120)
def test_accumulation_is_the_computation_of_data_parallel():
    import minidist as md
    import optim_workers

    batch = 64
    ranks = md.launch(optim_workers.ddp_gradients, 2, args=(SMALL, batch), transport="shm", timeout=90.0)
    problem = lb.make_problem(SMALL)
    model = lb.make_model(SMALL)
    lb.accumulate_gradients(model, problem.train_x[:batch], problem.train_y[:batch], micro_batch=batch // 2)
    for grads in ranks:
        for ddp_grad, p in zip(grads, model.parameters()):
            torch.testing.assert_close(ddp_grad, p.grad, rtol=1e-5, atol=1e-7)


def test_experiment_runs_every_method_and_batch_on_the_same_samples():
    results = lb.run_experiment(SMALL)
    assert [(r.method, r.batch) for r in results] == [(m, b) for m in lb.METHODS for b in (8, 32)]
    for r in results:
        assert r.steps == 256 // r.batch
        assert r.samples == [0, 64, 128, 192, 256]  # evaluated at the same sample counts
        assert r.eval_steps == [s // r.batch for s in r.samples]
        assert r.eval_loss[0] == pytest.approx(results[0].eval_loss[0])  # the same initial model
        assert len(r.train_loss) == r.steps
        assert r.eval_loss[-1] < r.eval_loss[0]  # it learned something
        base_lr = SMALL.lamb_lr if r.method == "lamb" else SMALL.adam_lr
        k = r.batch / SMALL.base_batch
        expected = base_lr * (k if r.method == "adam-linear" else math.sqrt(k))
        assert r.lr == pytest.approx(expected)
    # at k = 1 the two Adam rules are one run
    assert results[0].eval_loss == results[2].eval_loss and results[0].method == "adam-linear"
    rows = lb.summary_rows(results)
    assert rows[0][:4] == ["adam-linear", 8, SMALL.adam_lr, 32]


def test_experiment_config_refuses_misaligned_evaluations():
    with pytest.raises(ValueError, match="multiple"):
        lb.LargeBatchConfig(base_batch=32, samples=1000)
    with pytest.raises(ValueError, match="unknown methods"):
        lb.LargeBatchConfig(methods=("sgd",))


def test_plot_draws_a_line_per_run():
    import matplotlib

    matplotlib.use("Agg")
    results = lb.run_experiment(dataclasses.replace(SMALL, methods=("adam-sqrt",)))
    fig = lb.plot(results)
    assert len(fig.axes[0].lines) == len(results) == 2
