"""Mixture of experts and expert parallelism (``minidist.parallel.experts``).

One process: the router's rules (capacity, priority, gates, the load-balancing loss) against
hand-written references, and ``MoELayer`` against a dense computation (every expert on every
token, masked) and against the course's MLP (one expert).

Expert parallel: one ``md.launch`` per world size (2, 3, 4; 12 experts) runs every case
(``experts_workers.all_cases``); each rank's output, aux loss, input gradient, router and shared
gradients equal ``MoELayer`` applied to that rank's batch here, and each local expert's
gradient equals the one-process gradient summed over every rank's batch (float64, tight
tolerance). Bytes counted by ``comm.stats`` equal ``traffic.ep_bytes`` / ``tp_bytes`` exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

import experts_workers as w
import minidist as md
from minidist.models.transformer import MLP, TransformerConfig
from minidist.parallel import experts

pytestmark = pytest.mark.timeout(240)
WORLD_SIZES = (2, 3, 4)


def close(got, want, what=""):
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


# --- one process: the router ---------------------------------------------------------------------
def test_capacity_formula():
    assert experts.capacity(10, 2, 12, 1.0) == math.ceil(10 * 2 / 12) == 2
    assert experts.capacity(64, 1, 8, 1.25) == 10
    assert experts.capacity(7, 2, 4, None) == 7  # no limit: an expert can take every token once
    with pytest.raises(ValueError, match="capacity_factor"):
        experts.capacity(8, 1, 4, 0.0)


def test_priority_and_drops_against_a_loop():
    """Kept = the first C assignments of each expert in (token, slot) order; dropped = max(0, load - C)."""
    torch.manual_seed(0)
    logits = torch.randn(40, 6) + torch.tensor([3.0, 2.0, 0, 0, 0, 0])  # experts 0 and 1 over capacity
    r = experts.route(logits, top_k=2, capacity_factor=1.0)
    cap = math.ceil(40 * 2 / 6)
    seen = [0] * 6
    want = torch.zeros(40, 2, dtype=torch.bool)
    for token in range(40):
        for slot in range(2):
            e = int(r.experts[token, slot])
            want[token, slot] = seen[e] < cap
            seen[e] += 1
    assert torch.equal(r.kept, want)
    assert r.stats.capacity == cap and r.stats.load == seen
    assert r.stats.dropped == [max(0, load - cap) for load in seen]
    assert r.stats.dropped_total > 0 and sum(r.stats.kept) == int(want.sum())


def test_gates():
    torch.manual_seed(1)
    logits = torch.randn(5, 8, dtype=torch.float64)
    top2 = experts.route(logits, top_k=2, capacity_factor=None)
    chosen = logits.gather(1, top2.experts)
    close(top2.gates, torch.softmax(chosen, dim=-1), "top-2 gates = softmax over the top-2 logits (Mixtral)")
    top1 = experts.route(logits, top_k=1, capacity_factor=None)
    close(top1.gates[:, 0], torch.softmax(logits, -1).max(-1).values, "top-1 gate = the probability (Switch)")


def test_aux_loss():
    torch.manual_seed(2)
    logits = torch.randn(12, 4, dtype=torch.float64)
    r = experts.route(logits, top_k=2, capacity_factor=1.0)
    f = torch.tensor(r.stats.load, dtype=torch.float64) / (12 * 2)
    close(r.aux_loss, 4 * (f * torch.softmax(logits, -1).mean(0)).sum(), "E * sum f_i P_i")
    uniform = experts.route(torch.zeros(12, 4), top_k=2, capacity_factor=None)
    assert uniform.aux_loss.item() == pytest.approx(1.0)  # P_i = 1/E: sum f_i = 1 whatever the choice
    collapsed = experts.route(torch.tensor([[30.0, 0, 0, 0]] * 12), top_k=1, capacity_factor=None)
    assert collapsed.aux_loss.item() == pytest.approx(4.0)  # everything on one expert: E


# --- one process: the layer ----------------------------------------------------------------------
@pytest.mark.parametrize("case", list(w.CASES))
def test_moe_layer_against_dense_mixture(case):
    """y = sum_e [kept] gate_e * FFN_e(x), with every expert computed on every token."""
    moe = w.build(case)
    x, _ = w.batch(case, 0)
    y = moe(x)
    r = moe.route(x)
    want = moe.shared(x) if moe.shared is not None else torch.zeros_like(x)
    for e, expert in enumerate(moe.experts):
        weight = ((r.experts == e) & r.kept).to(x.dtype).mul(r.gates).sum(1, keepdim=True)
        want = want + weight * expert(x)
    close(y, want, case)
    assert moe.last_stats == r.stats


def test_one_expert_is_the_course_mlp():
    cfg = TransformerConfig(
        vocab_size=8, hidden_size=8, n_layers=1, n_heads=2, max_positions=4, intermediate_size=16
    )
    mlp = MLP(cfg).double()
    moe = experts.MoELayer(8, 16, 1, top_k=1, capacity_factor=None).double()
    moe.experts[0].load_state_dict(mlp.state_dict())
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    close(moe(x), mlp(x), "E = 1, k = 1: the gate is 1 and the layer is the dense MLP")


# --- expert parallel ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=WORLD_SIZES)
def run(request):
    p = request.param
    return p, md.launch(w.all_cases, world_size=p, transport="pipe", timeout=120)


def reference(case: str, p: int) -> tuple[list[dict], dict]:
    """MoELayer on each rank's batch: per-rank results, and the parameter gradients summed over ranks."""
    moe = w.build(case)
    per_rank = []
    for rank in range(p):
        moe.zero_grad()
        x, weights = w.batch(case, rank)
        x.requires_grad_(True)
        y = moe(x)
        ((y * weights).sum() + w.AUX_WEIGHT * moe.aux_loss).backward()
        per_rank.append(
            {"y": y.detach(), "aux": moe.aux_loss.detach(), "x_grad": x.grad, "grads": w.grads(moe)}
        )
        per_rank[-1]["stats"] = moe.last_stats
    total = {name: sum(r["grads"][name] for r in per_rank) for name in per_rank[0]["grads"]}
    return per_rank, total


@pytest.mark.parametrize("case", list(w.CASES))
def test_ep_equals_one_process(run, case):
    p, outs = run
    per_rank, total = reference(case, p)
    per = w.EXPERTS // p
    for rank, out in enumerate(outs):
        got, want = out[case], per_rank[rank]
        close(got["y"], want["y"], f"{case} p={p} rank {rank} output")
        close(got["aux"], want["aux"], f"{case} rank {rank} aux loss")
        close(got["x_grad"], want["x_grad"], f"{case} rank {rank} input gradient")
        assert got["stats"] == want["stats"]
        for name, grad in got["grads"].items():
            if name.startswith("experts."):  # local expert j is global expert first + j: all ranks' tokens
                j, rest = name.split(".", 2)[1:]
                close(
                    grad,
                    total[f"experts.{got['first_expert'] + int(j)}.{rest}"],
                    f"{case} rank {rank} {name}",
                )
            else:  # router, shared experts: replicated, this rank's tokens only
                close(grad, want["grads"][name], f"{case} rank {rank} {name}")
        assert got["first_expert"] == rank * per and len(
            [n for n in got["grads"] if n.endswith("down.weight")]
        ) == (per + (1 if w.CASES[case]["shared"] else 0))


def test_ep_drops_against_capacity(run):
    p, outs = run
    for case, settings in w.CASES.items():
        for out in outs:
            stats = out[case]["stats"]
            assert stats.capacity == experts.capacity(
                w.TOKENS, settings["top_k"], w.EXPERTS, settings["capacity_factor"]
            )
            assert stats.dropped == [max(0, load - stats.capacity) for load in stats.load]
            assert sum(stats.load) == w.TOKENS * settings["top_k"]
        dropped = sum(out[case]["stats"].dropped_total for out in outs)
        assert (dropped > 0) == (settings["capacity_factor"] is not None and settings["skew"] > 0), case
        # every kept row reached its expert's rank: what the experts received = what was kept
        received = sum(sum(out[case]["received"]) for out in outs)
        assert received == sum(sum(out[case]["stats"].kept) for out in outs)


def test_ep_bytes_equal_the_formula(run):
    p, outs = run
    itemsize = 8
    for case in w.CASES:
        total_off = 0
        for rank, out in enumerate(outs):
            o = out[case]
            received_off = sum(o["rows_from"]) - o["rows_from"][rank]
            want = experts.ep_bytes(o["off_rank"], received_off, w.D, itemsize, w.EXPERTS, p)
            assert o["forward_bytes"] == want, (case, rank)
            counts = 8 * (w.EXPERTS // p) * (p - 1)
            assert o["backward_bytes"] == want - counts, (case, rank)  # backward reuses the sizes
            assert o["forward_messages"] == 3 * (p - 1)  # counts, dispatch, combine
            total_off += o["off_rank"]
        counts_all = p * 8 * (w.EXPERTS // p) * (p - 1)
        kept = sum(sum(out[case]["stats"].kept) for out in outs)
        measured = (sum(out[case]["forward_bytes"] for out in outs) - counts_all) / (p * w.TOKENS)
        k = w.CASES[case]["top_k"]
        fraction = total_off / (p * w.TOKENS * k)
        assert measured == pytest.approx(experts.bytes_per_token(w.D, k, p, itemsize, fraction)["ep"])
        assert kept >= total_off


def test_tp_experts_equal_one_process_and_the_formula(run):
    p, outs = run
    case = "no-drop-gelu-top2"
    moe = w.build(case)
    x, weights = w.batch(case, 0)
    x.requires_grad_(True)
    y = moe(x)
    (y * weights).sum().backward()
    for rank, out in enumerate(outs):
        close(out["tp"]["y"], y.detach(), f"TP experts rank {rank}")
        close(out["tp"]["x_grad"], x.grad, f"TP experts rank {rank} input gradient")
        assert out["tp"]["forward_bytes"] == experts.tp_bytes(w.TOKENS, w.D, 8, p)
    per_token = sum(out["tp"]["forward_bytes"] for out in outs) / w.TOKENS  # the ranks share the tokens
    ep_measured = sum(out[case]["forward_bytes"] - 8 * (w.EXPERTS // p) * (p - 1) for out in outs) / (
        p * w.TOKENS
    )
    fraction = sum(out[case]["off_rank"] for out in outs) / (p * w.TOKENS * 2)
    formula = experts.bytes_per_token(w.D, 2, p, 8, fraction)
    assert per_token == pytest.approx(formula["tp"])
    print(
        f"\np={p} bytes/token  EP measured {ep_measured:.1f} formula {formula['ep']:.1f}"
        f"  |  TP measured {per_token:.1f} formula {formula['tp']:.1f}"
    )


def test_expert_parallel_decoder_equals_one_process(run):
    """A whole MoE decoder (``distribute_experts``): loss, logits and every gradient, with drops."""
    p, outs = run
    model = w.decoder_model()
    per_rank = []
    for rank in range(p):
        model.zero_grad()
        ids = w.decoder_batch(rank)
        out = model(ids, labels=ids)
        out.loss.backward()
        per_rank.append({"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": w.grads(model)})
    total = {name: sum(r["grads"][name] for r in per_rank) for name in per_rank[0]["grads"]}
    for rank, out in enumerate(outs):
        got, want = out["decoder"], per_rank[rank]
        close(got["loss"], want["loss"], f"rank {rank} loss")
        close(got["logits"], want["logits"], f"rank {rank} logits")
        for name, grad in got["grads"].items():
            if ".mlp.experts." in name:  # blocks.L.mlp.experts.j.rest -> global expert first + j
                head, rest = name.split(".mlp.experts.")
                j, rest = rest.split(".", 1)
                layer = int(head.rsplit(".", 1)[1])
                global_name = f"{head}.mlp.experts.{got['first_expert'][layer] + int(j)}.{rest}"
                close(grad, total[global_name], f"rank {rank} {name}")
            else:
                close(grad, want["grads"][name], f"rank {rank} {name}")
    assert sum(sum(out["decoder"]["dropped"]) for out in outs) > 0  # capacity 1.0 dropped some


def test_uneven_experts_refused(run):
    p, outs = run
    assert f"{p + 1} experts cannot be split evenly over {p} ranks" in outs[0]["uneven"]
