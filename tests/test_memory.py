"""minidist.memory: measured bytes (storages, saved-for-backward tensors, RSS) and the calculator.

Every formula is checked against an independent reference: bytes torch really holds
(``tensor_bytes`` over storages), tensors autograd really saves (saved-tensor hooks), a paper's
table (ZeRO, Table 1), published parameter counts, or a published FLOP count.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minidist import memory

pytestmark = pytest.mark.timeout(120)


# --- measurement ------------------------------------------------------------------------------
def test_tensor_bytes_counts_each_storage_once():
    x = torch.zeros(10, 20)  # 800 bytes
    assert memory.tensor_bytes(x) == 800
    # views share the storage; a list holding the tensor twice and a view counts it once
    assert memory.tensor_bytes([x, x[0], x.t(), {"again": x}]) == 800
    # a small view keeps the whole buffer: counted in full
    assert memory.tensor_bytes(x[:1, :1]) == 800
    y = torch.zeros(5, dtype=torch.float64)
    assert memory.tensor_bytes((x, y)) == 800 + 40


def test_tensor_bytes_of_module_grads_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 8))
    model[2].weight = nn.Parameter(torch.randn(8, 16))
    n_params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert memory.tensor_bytes(model) == 4 * n_params + buffers
    model(torch.randn(4, 8)).sum().backward()
    assert memory.tensor_bytes(model) == 8 * n_params + buffers
    opt = torch.optim.AdamW(model.parameters())
    assert memory.tensor_bytes(opt) == 0  # no state before the first step
    opt.step()
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    assert memory.tensor_bytes(opt) == 8 * n_params + steps


def test_tied_parameter_counts_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    assert memory.tensor_bytes(nn.ModuleList([emb, head])) == 10 * 4 * 4


def test_saved_activation_bytes_of_a_linear_and_a_relu():
    lin = nn.Linear(6, 5)
    x = torch.randn(3, 6)
    # a linear saves its input (the weight is a parameter: not counted)
    assert memory.saved_activation_bytes(lin, x) == 3 * 6 * 4
    # relu saves its output: one more (3, 5) storage
    assert memory.saved_activation_bytes(lambda t: torch.relu(lin(t)), x) == 3 * 6 * 4 + 3 * 5 * 4
    # under no_grad nothing is saved
    with torch.no_grad():
        assert memory.saved_activation_bytes(lin, x) == 0


def test_rss_reads_proc():
    if not memory.reset_peak_rss():
        pytest.skip("/proc/self/clear_refs not writable here")
    before = memory.rss_bytes()
    assert memory.peak_rss_bytes() >= before > 0
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert memory.rss_bytes() - before > 48 * 2**20
    del big
    assert memory.peak_rss_bytes() - before > 48 * 2**20
