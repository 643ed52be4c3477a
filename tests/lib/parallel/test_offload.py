"""OffloadedAdamW (minidist.parallel.offload): torch's AdamW, with its state in files and RSS within a budget.

References: ``torch.optim.AdamW`` on a copy of the same model (the same arithmetic, so equal), and the
process's own resident memory (VmHWM in /proc) measured in a child process (``offload.measure_rss_growth``).
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
from torch import nn

from minidist.parallel import offload
from minidist.parallel.offload import OffloadedAdamW

PAGE = offload.PAGE_ELEMENTS


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 37·300 + 300 + 300·5 + 5 = 12905 parameters: several chunks of one page, pieces that cross them.
    return nn.Sequential(nn.Linear(37, 300), nn.Tanh(), nn.Linear(300, 5))


def train(model, opt, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 37, generator=gen)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize(
    ("budget_pages", "sync"), [(1, True), (1000, True), (1, False)], ids=["13-chunks", "1-chunk", "no-msync"]
)
def test_equals_torch_adamw(tmp_path, budget_pages, sync):
    reference = tiny_model()
    model = copy.deepcopy(reference)
    hyper = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    budget = budget_pages * PAGE * 16  # 16 bytes per element: m, v and two temporaries
    torch_opt = torch.optim.AdamW(reference.parameters(), **hyper)
    with OffloadedAdamW(model.parameters(), tmp_path, budget, sync_to_disk=sync, **hyper) as opt:
        assert opt.chunk == min(budget_pages, 1000) * PAGE
        train(reference, torch_opt, 10)
        train(model, opt, 10)
        for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, ref)
        for key in ("exp_avg", "exp_avg_sq"):
            flat = torch.cat([torch_opt.state[p][key].reshape(-1) for p in reference.parameters()])
            assert torch.equal(opt.read_state(key), flat)
    assert not any(tmp_path.iterdir())  # the files are gone with the with-block


def test_param_groups_and_missing_grads(tmp_path):
    reference = tiny_model()
    model = copy.deepcopy(reference)

    def groups(m):
        return [
            {"params": [m[0].weight, m[0].bias], "lr": 1e-2, "weight_decay": 0.0},
            {"params": [m[2].weight, m[2].bias], "lr": 5e-2},
        ]

    torch_opt = torch.optim.AdamW(groups(reference), weight_decay=0.3)
    with OffloadedAdamW(groups(model), tmp_path, PAGE * 16, weight_decay=0.3) as opt:
        for m in (reference, model):
            m[2].bias.requires_grad_(False)  # never gets a grad: must stay as it is
        train(reference, torch_opt, 5)
        train(model, opt, 5)
        for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, ref)


def test_master_weights_in_bf16(tmp_path):
    """bf16 parameters with an fp32 master copy on disk = fp32 AdamW, rounded to bf16 after each step."""
    model = tiny_model().to(torch.bfloat16)
    master = copy.deepcopy(model).float()  # the master copy starts from the bf16 weights
    torch_opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    with OffloadedAdamW(model.parameters(), tmp_path, PAGE * 20, lr=1e-2, master_weights=True) as opt:
        gen = torch.Generator().manual_seed(3)
        for _ in range(5):
            x = torch.randn(8, 37, generator=gen).to(torch.bfloat16)
            opt.zero_grad()
            model(x).float().square().mean().backward()
            # The reference gets the same (bf16) gradients, in fp32.
            torch_opt.zero_grad()
            for p, q in zip(master.parameters(), model.parameters(), strict=True):
                p.grad = q.grad.float()
            torch_opt.step()
            opt.step()
            for p, q in zip(master.parameters(), model.parameters(), strict=True):
                assert torch.equal(q, p.detach().to(torch.bfloat16))
        flat = torch.cat([p.detach().reshape(-1) for p in master.parameters()])
        assert torch.equal(opt.read_state("master"), flat)


def test_files_are_removed_on_close_and_by_the_garbage_collector(tmp_path):
    opt = OffloadedAdamW(tiny_model().parameters(), tmp_path, PAGE * 16)
    (folder,) = tmp_path.iterdir()
    assert sorted(f.name for f in folder.iterdir()) == ["exp_avg.f32", "exp_avg_sq.f32"]
    assert (folder / "exp_avg.f32").stat().st_size == 4 * 12905
    opt.close()
    opt.close()  # idempotent
    assert not any(tmp_path.iterdir())
    with pytest.raises(RuntimeError, match="after close"):
        opt.step()

    model = tiny_model()
    opt = OffloadedAdamW(model.parameters(), tmp_path, PAGE * 16)
    train(model, opt, 1)
    assert any(tmp_path.iterdir())
    del opt
    gc.collect()
    assert not any(tmp_path.iterdir())


def test_clear_errors(tmp_path):
    params = tiny_model().parameters
    smallest = PAGE * 4 * 4  # one page of m, v and two temporaries
    assert offload.chunk_elements(smallest) == PAGE
    with pytest.raises(ValueError, match=f"smaller than one chunk.*{smallest} bytes"):
        OffloadedAdamW(params(), tmp_path, smallest - 1)
    with pytest.raises(ValueError, match="does not exist"):
        OffloadedAdamW(params(), tmp_path / "missing", smallest)
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="not a folder"):
        OffloadedAdamW(params(), a_file, smallest)
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            OffloadedAdamW(params(), locked, smallest)
    with pytest.raises(ValueError, match="lr"):
        OffloadedAdamW(params(), tmp_path, smallest, lr=-1.0)
    with pytest.raises(ValueError, match="contiguous"):
        OffloadedAdamW([torch.zeros(4, 3).t().requires_grad_()], tmp_path, smallest)
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]  # nothing left behind by the failures


def run_worker(**kwargs) -> dict:
    result = offload.measure_rss_growth(**kwargs, timeout=120)
    if "error" in result:
        pytest.skip(result["error"])
    return result


SLACK = 2 << 20  # the stated overhead beside budget + forward/backward: interpreter and allocator noise


def test_resident_memory_stays_within_the_budget():
    """State 4x the budget: RSS growth over training <= budget + forward/backward's own + 2 MiB.

    The control run is the same optimizer without dropping its pages after each chunk: the mapped
    state then stays resident and the growth is the whole state, so the measurement can tell.
    """
    budget = 6 << 20
    setup = dict(width=512, layers=12, budget_bytes=budget, steps=2, optimizer="offload")
    kept = run_worker(drop_pages=True, **setup)
    assert kept["state_bytes"] >= 4 * budget
    assert kept["growth"] <= budget + kept["forward_backward"] + SLACK, kept
    control = run_worker(drop_pages=False, **setup)
    assert control["growth"] >= 0.9 * control["state_bytes"], control
    assert control["growth"] > budget + kept["forward_backward"] + SLACK, control  # the bound above fails


def test_measure_offload(tmp_path):
    result = offload.measure_offload(tmp_path, PAGE * 16 * 8, width=64, layers=2, steps=2)
    assert result["max_abs_diff"] == 0.0
    assert result["n_params"] == 2 * (64 * 64 + 64)
    assert result["chunks"] == -(-result["n_params"] // (PAGE * 8))
    assert result["ratio"] == result["offload_step_s"] / result["adamw_step_s"]
    assert 0 < result["offload_best_s"] <= result["offload_step_s"]
    assert 0 < result["adamw_best_s"] <= result["adamw_step_s"]
    assert not any(tmp_path.iterdir())


def test_measure_rss_growth_rejects_bad_input():
    with pytest.raises(ValueError, match="optimizer must be"):
        offload.measure_rss_growth(optimizer="sgd")
    with pytest.raises(ValueError, match="smaller than one chunk"):
        offload.measure_rss_growth(budget_bytes=100)
