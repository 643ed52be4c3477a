"""The released stubs: every signature and docstring of the solution kept, every task a clear TODO.

Read from the files' syntax trees (signatures, docstrings, the ``raise NotImplementedError``
lines) and probed in a fresh interpreter with only the stub's folder on the path (each part
raises NotImplementedError naming its task). Fast: nothing runs a test or a worker. What the
public and hidden tests do on the stubs and the solutions is in ``test_assignments.py``.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = "a1_collectives"
SOLUTION = ROOT / "solutions" / NAME
STUB = ROOT / "assignments" / NAME
FUNCTIONS = [
    "tree_broadcast",
    "ring_allgather",
    "ring_reduce_scatter",
    "ring_allreduce",
    "butterfly_allreduce",
    "fast_allreduce",
]


def public_signatures(path: Path) -> dict[str, tuple]:
    """name -> (arguments, docstring) of every top-level function, read without importing."""
    tree = ast.parse(path.read_text())
    return {
        node.name: (
            ast.dump(node.args),
            ast.get_docstring(node),
            ast.dump(node.returns) if node.returns else None,
        )
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }


def test_stub_keeps_every_signature_and_docstring():
    solution, stub = (
        public_signatures(SOLUTION / "collectives.py"),
        public_signatures(STUB / "collectives.py"),
    )
    assert set(FUNCTIONS) <= set(solution)
    assert stub == solution


STUB_PROBE = """
import sys

import torch

import collectives

for task, name in enumerate(sys.argv[1:], start=1):
    extra = [0] if name == "tree_broadcast" else []  # src
    try:
        getattr(collectives, name)(None, torch.zeros(2), *extra)
    except NotImplementedError as error:
        assert f"TODO(task {task})" in str(error), (name, str(error))
    else:
        raise AssertionError(f"{name} did not raise NotImplementedError")
print("ok")
"""


#: the end of every probe below: each part of ``calls`` raises NotImplementedError naming its task
CALL_EACH = """
for task, name in %r:
    try:
        calls[name]()
    except NotImplementedError as error:
        assert f"TODO(task {task}): write {name}" in str(error), (name, str(error))
    else:
        raise AssertionError(f"{name} did not raise NotImplementedError")
print("ok")
"""


def run_probe(tmp_path: Path, source: str, stub: Path, *args: str) -> None:
    """Run ``source`` in a fresh interpreter with only ``stub`` on the path; it must print "ok"."""
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(stub)}
    result = subprocess.run(
        [sys.executable, str(probe), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_stub_imports_and_each_function_raises_not_implemented_with_its_task(tmp_path):
    run_probe(tmp_path, STUB_PROBE, STUB, *FUNCTIONS)


# --- assignment 2: async parameter server and Hogwild -----------------------------------------
A2 = "a2_async"
A2_SOLUTION, A2_STUB = ROOT / "solutions" / A2, ROOT / "assignments" / A2
#: (task, function): the server's learning rate is part of task 1, the server
A2_TASKS = [
    (1, "staleness_aware_lr"),
    (1, "run_server"),
    (2, "ps_worker"),
    (3, "hogwild_worker"),
    (4, "prefetching_worker"),
]


def test_a2_stub_keeps_every_signature_and_docstring():
    solution = public_signatures(A2_SOLUTION / "async_ps.py")
    assert {name for _, name in A2_TASKS} <= set(solution)
    assert public_signatures(A2_STUB / "async_ps.py") == solution
    stub = (A2_STUB / "async_ps.py").read_text()
    for task, name in A2_TASKS:
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stub


# --- assignment 3: bucketed DDP that overlaps backward ----------------------------------------
A3 = "a3_ddp"
A3_SOLUTION, A3_STUB = ROOT / "solutions" / A3, ROOT / "assignments" / A3
#: (task, what the stub's NotImplementedError names)
A3_TASKS = [
    (1, "assign_buckets"),
    (2, "_on_gradient_ready"),
    (2, "_launch"),
    (2, "no_sync"),
    (3, "_finish_backward"),
    (4, "tuned_bucket_mb"),
]


def test_a3_stub_keeps_every_signature_and_docstring():
    solution = public_signatures(A3_SOLUTION / "ddp.py")
    assert "assign_buckets" in solution
    assert public_signatures(A3_STUB / "ddp.py") == solution
    stub = (A3_STUB / "ddp.py").read_text()
    for task, name in A3_TASKS:
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stub


A3_STUB_PROBE = """
import torch
from torch import nn

import ddp

param = nn.Parameter(torch.zeros(3))
blank = object.__new__(ddp.BucketedDDP)  # no __init__: it would stop at task 1
calls = {
    "assign_buckets": lambda: ddp.assign_buckets([("w", param)], 1.0),
    "_on_gradient_ready": lambda: blank._on_gradient_ready(param),
    "_launch": lambda: blank._launch(ddp.Bucket.of(0, ["w"], [param])),
    "_finish_backward": lambda: blank._finish_backward(),
    "no_sync": lambda: blank.no_sync().__enter__(),
    "tuned_bucket_mb": lambda: ddp.tuned_bucket_mb([("w", param)], 1e-3, {"w": 2e-3}, 5e-5, 1.25e8, 2),
}
"""


def test_a3_stub_imports_and_each_part_raises_not_implemented_with_its_task(tmp_path):
    run_probe(tmp_path, (A3_STUB_PROBE + CALL_EACH) % (A3_TASKS,), A3_STUB)


# --- assignment 4: Deep Gradient Compression as a DDP communication hook ----------------------
A4 = "a4_compression"
A4_SOLUTION, A4_STUB = ROOT / "solutions" / A4, ROOT / "assignments" / A4
#: (task, what the stub's NotImplementedError names)
A4_TASKS = [
    (1, "select_indices"),
    (2, "sparsity_at"),
    (2, "clip_local"),
    (2, "compress_step"),
    (3, "SparseWork.wait"),
    (3, "DGCHook.__call__"),
    (4, "measured_hook"),
]


def test_a4_stub_keeps_every_signature_and_docstring():
    solution = public_signatures(A4_SOLUTION / "dgc.py")
    assert "select_indices" in solution
    assert public_signatures(A4_STUB / "dgc.py") == solution
    stub = (A4_STUB / "dgc.py").read_text()
    for task, name in A4_TASKS:
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stub


A4_STUB_PROBE = """
import torch

import dgc

config, grad = dgc.DGCConfig(), torch.ones(8)
calls = {
    "sparsity_at": lambda: dgc.sparsity_at(0, config),
    "clip_local": lambda: dgc.clip_local(grad, 1.0, 2),
    "select_indices": lambda: dgc.select_indices(grad, 2, config, torch.Generator()),
    "compress_step": lambda: dgc.compress_step(
        dgc.DGCState.zeros_like(grad), grad, config, 1, torch.Generator()
    ),
    "SparseWork.wait": lambda: dgc.SparseWork(None, 8, 1).wait(),
    "DGCHook.__call__": lambda: dgc.DGCHook(config)(None, grad, 0),
    "measured_hook": lambda: dgc.measured_hook(),
}
"""


def test_a4_stub_imports_and_each_part_raises_not_implemented_with_its_task(tmp_path):
    run_probe(tmp_path, (A4_STUB_PROBE + CALL_EACH) % (A4_TASKS,), A4_STUB)


# --- assignment 5: tensor-parallel MLP, the pipeline schedules and their stage step -----------
A5 = "a5_model_parallel"
A5_SOLUTION, A5_STUB = ROOT / "solutions" / A5, ROOT / "assignments" / A5
A5_FILES = ("tp_layers.py", "schedule.py")
#: (task, what the stub's NotImplementedError names)
A5_TASKS = [
    (1, "CopyToTensorParallel.forward"),
    (1, "CopyToTensorParallel.backward"),
    (2, "ReduceFromTensorParallel.forward"),
    (2, "ReduceFromTensorParallel.backward"),
    (1, "ColumnParallelLinear.__init__"),
    (1, "ColumnParallelLinear.load_dense"),
    (1, "ColumnParallelLinear.forward"),
    (2, "RowParallelLinear.__init__"),
    (2, "RowParallelLinear.load_dense"),
    (2, "RowParallelLinear.forward"),
    (3, "ParallelMLP.__init__"),
    (3, "ParallelMLP.load_dense"),
    (3, "ParallelMLP.forward"),
    (4, "one_f_one_b"),
    (4, "fast_schedule"),
    (5, "run_stage"),
]


def a5_api(path: Path) -> dict[str, tuple]:
    """name -> (arguments, docstring) of every top-level function, class and method (not imported)."""
    tree = ast.parse(path.read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = (ast.dump(node.args), ast.get_docstring(node))
        elif isinstance(node, ast.ClassDef):
            out[node.name] = ([ast.dump(base) for base in node.bases], ast.get_docstring(node))
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = (ast.dump(item.args), ast.get_docstring(item))
    return out


def test_a5_stub_keeps_every_signature_and_docstring():
    for name in A5_FILES:
        solution = a5_api(A5_SOLUTION / name)
        assert a5_api(A5_STUB / name) == solution, name
    assert "ColumnParallelLinear.load_dense" in a5_api(A5_SOLUTION / "tp_layers.py")
    stubs = "".join((A5_STUB / name).read_text() for name in A5_FILES)
    for task, name in A5_TASKS:
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stubs


A5_STUB_PROBE = """
from types import SimpleNamespace

import torch
from torch import nn

import schedule
import tp_layers as tp

comm, x = SimpleNamespace(rank=0, world_size=2), torch.ones(2, 4)
ctx = SimpleNamespace(comm=comm)


def blank(cls):
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    return obj


calls = {
    "CopyToTensorParallel.forward": lambda: tp.CopyToTensorParallel.forward(ctx, x, comm),
    "CopyToTensorParallel.backward": lambda: tp.CopyToTensorParallel.backward(ctx, x),
    "ReduceFromTensorParallel.forward": lambda: tp.ReduceFromTensorParallel.forward(ctx, x, comm),
    "ReduceFromTensorParallel.backward": lambda: tp.ReduceFromTensorParallel.backward(ctx, x),
    "one_f_one_b": lambda: schedule.one_f_one_b(2, 2),
    "fast_schedule": lambda: schedule.fast_schedule(2, 2),
    "run_stage": lambda: schedule.run_stage(nn.Identity(), comm, [("F", 0)], [x], None, None, (2, 4)),
}
for cls in ("ColumnParallelLinear", "RowParallelLinear"):
    calls[f"{cls}.__init__"] = lambda cls=cls: getattr(tp, cls)(4, 4, comm)
    calls[f"{cls}.load_dense"] = lambda cls=cls: blank(getattr(tp, cls)).load_dense(torch.ones(4, 4), None)
    calls[f"{cls}.forward"] = lambda cls=cls: blank(getattr(tp, cls)).forward(x)
calls["ParallelMLP.__init__"] = lambda: tp.ParallelMLP(4, 8, comm)
calls["ParallelMLP.load_dense"] = lambda: blank(tp.ParallelMLP).load_dense(None)
calls["ParallelMLP.forward"] = lambda: blank(tp.ParallelMLP).forward(x)
"""


def test_a5_stub_imports_and_each_part_raises_not_implemented_with_its_task(tmp_path):
    run_probe(tmp_path, (A5_STUB_PROBE + CALL_EACH) % (A5_TASKS,), A5_STUB)


# --- assignment 6: int8, NF4 and its packing, a KV-cached attention step, generation, a format --
A6 = "a6_inference"
A6_SOLUTION, A6_STUB = ROOT / "solutions" / A6, ROOT / "assignments" / A6
#: (task, what the stub's NotImplementedError names)
A6_TASKS = [
    (1, "quantize_int8"),
    (1, "dequantize_int8"),
    (1, "pack_4bit"),
    (1, "unpack_4bit"),
    (1, "quantize_nf4"),
    (1, "dequantize_nf4"),
    (2, "attention_step"),
    (3, "decoder_step"),
    (3, "generate"),
    (4, "quantize_model"),
]


def test_a6_stub_keeps_every_signature_and_docstring():
    solution = a5_api(A6_SOLUTION / "inference.py")
    assert a5_api(A6_STUB / "inference.py") == solution
    assert {"NF4Weight.nbytes", "TinyDecoder.__init__", "attention_step"} <= set(solution)
    stub = (A6_STUB / "inference.py").read_text()
    for task, name in A6_TASKS:
        assert f'raise NotImplementedError("TODO(task {task}): write {name}")' in stub


A6_STUB_PROBE = """
import torch
from torch import nn

import inference as a6

w, model = torch.ones(2, 4), a6.TinyDecoder(vocab=5, d=4, n_heads=2, n_layers=1, positions=8)
q = a6.NF4Weight(torch.zeros(2, dtype=torch.uint8), torch.ones(1), (4,), 4)
linear = nn.Linear(4, 4)
calls = {
    "quantize_int8": lambda: a6.quantize_int8(w),
    "dequantize_int8": lambda: a6.dequantize_int8(w.to(torch.int8), torch.ones(2, 1)),
    "pack_4bit": lambda: a6.pack_4bit(torch.zeros(4, dtype=torch.long)),
    "unpack_4bit": lambda: a6.unpack_4bit(torch.zeros(2, dtype=torch.uint8)),
    "quantize_nf4": lambda: a6.quantize_nf4(w, 4),
    "dequantize_nf4": lambda: a6.dequantize_nf4(q),
    "attention_step": lambda: a6.attention_step(linear, linear, linear, linear, 2, torch.ones(1, 3, 4)),
    "decoder_step": lambda: a6.decoder_step(model, torch.zeros(1, 3, dtype=torch.long)),
    "generate": lambda: a6.generate(model, torch.zeros(1, 3, dtype=torch.long), 2),
    "quantize_model": lambda: a6.quantize_model({"transformer.blocks.0.mlp.up.weight": w}),
}
assert q.nbytes == 2 + 4  # given
"""


def test_a6_stub_imports_and_each_part_raises_not_implemented_with_its_task(tmp_path):
    run_probe(tmp_path, (A6_STUB_PROBE + CALL_EACH) % (A6_TASKS,), A6_STUB)
