"""Mixed precision for the BERT step: bf16 autocast, and fp16 with fp32 master weights and loss scaling.

Two ways to compute in 16 bits while the weights stay exact enough to keep learning:

bf16 autocast (``torch.autocast("cpu", dtype=torch.bfloat16)``)
    Weights, gradients and Adam's state stay fp32; inside the ``with`` block matrix multiplies
    run in bf16 (8 exponent bits like fp32, so no over/underflow and no loss scaling; 8 bits of
    mantissa, so about 2-3 significant digits) and numerically touchy ops (softmax,
    cross-entropy, LayerNorm) stay fp32. Memory of the *state* is unchanged; activations are
    halved; speed depends on the CPU's bf16 support (measured, not assumed: ``step_time``).

fp16 with fp32 master weights (Micikevicius et al., 2018), ``Fp16MasterWeights``
    fp16 has 5 exponent bits: gradients below 6e-8 vanish and values above 65504 overflow.
    The recipe, and the choice made here (a half model copy, not autocast):

        fp32 master weights ──copy──► fp16 model ──forward/backward of loss·S──► fp16 grads
              ▲                                                                     │
              └── optimizer step (fp32) ◄── unscale ÷S in fp32, inf/nan? skip ◄─────┘

    The model itself is converted to fp16 (every op runs in half: the simplest picture of
    "16-bit compute", and it runs on the CPU too), a deep copy stays in fp32 and is what the
    optimiser updates: an update lr·Δ much smaller than the weight would round away in fp16
    (1 + 1e-4 == 1 in fp16), and it does not in fp32. Gradients are copied to fp32 before
    they are unscaled, so dividing by S cannot underflow. ``DynamicLossScaler`` picks S.

The functions here take the model as a factory and the data as batches (``optim`` knows no
BERT); ``minidist.models.bert_experiments`` supplies BERT (``bert_factory``, ``bert_batches``).

Memory per parameter with Adam (bytes; measured by ``state_bytes``):

    fp32 / bf16 autocast   params 4   grads 4       Adam 8   = 16
    fp16 + fp32 master     params 2+4 grads 2+4     Adam 8   = 20   (activations halved)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from minidist.optim.groups import param_groups
from minidist.optim.loss_scaling import DynamicLossScaler

__all__ = [
    "PRECISIONS",
    "Fp16MasterWeights",
    "default_loss",
    "loss_curves",
    "state_bytes",
    "step_time",
    "tensor_bytes",
]

PRECISIONS = ("fp32", "bf16", "fp16")


class Fp16MasterWeights:
    """Train ``model`` in fp16 with fp32 master weights; ``make_optimizer(master)`` builds the optimiser.

    ``model`` is converted to fp16 in place (``self.model``); ``self.master`` is its fp32
    copy, taken before the conversion. One step::

        loss = trainer.model(x16...)            # fp16 forward
        stepped = trainer.backward_and_step(loss)

    ``backward_and_step`` scales the loss, runs backward, copies the fp16 gradients into fp32
    master gradients, unscales and checks them, steps the optimiser (or skips the step and
    shrinks the scale), copies the master weights back into the fp16 model and clears the
    gradients. Returns whether the optimiser stepped.
    """

    def __init__(
        self,
        model: nn.Module,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        scaler: DynamicLossScaler | None = None,
    ) -> None:
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError("pass the model in fp32: the master copy is taken from it before it is halved")
        self.master = copy.deepcopy(model)
        self.model = model.half()
        self.optimizer = make_optimizer(self.master)
        self.scaler = scaler or DynamicLossScaler()
        self._pairs = list(zip(self.model.parameters(), self.master.parameters()))

    def backward_and_step(self, loss: torch.Tensor) -> bool:
        self.scaler.scale_loss(loss.float()).backward()
        for half, master in self._pairs:
            master.grad = None if half.grad is None else half.grad.float()
        stepped = self.scaler.step(self.optimizer, [m for _, m in self._pairs])
        with torch.no_grad():
            if stepped:
                for half, master in self._pairs:
                    half.copy_(master)
        for half, master in self._pairs:
            half.grad = None
            master.grad = None
        return stepped


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v for v in s.values() if torch.is_tensor(v)) for s in optimizer.state.values())


def default_loss(model: nn.Module, batch) -> torch.Tensor:
    """``model(inputs, labels=labels).loss`` for ``batch = (inputs, labels)`` (BERT, the decoder)."""
    inputs, labels = batch
    return model(inputs, labels=labels).loss


def _default_optimizer(module: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(module, 0.01), lr=lr)


def loss_curves(
    make_model: Callable[[], nn.Module],
    batches: Sequence,
    lr: float = 1e-3,
    precisions: tuple[str, ...] = ("fp32", "bf16"),
    loss_fn: Callable[[nn.Module, object], torch.Tensor] = default_loss,
) -> dict[str, list[float]]:
    """Training loss per step, per precision, from the same initial weights on the same ``batches``.

    ``make_model()`` must return a fresh fp32 model with the same weights every call (seed it).
    "fp32": plain; "bf16": forward and loss under ``torch.autocast("cpu", torch.bfloat16)``,
    fp32 weights and optimiser; "fp16": ``Fp16MasterWeights`` with ``DynamicLossScaler(2**12)``.
    AdamW with weight decay 0.01 on matrices (``param_groups``), constant ``lr``.
    """
    _check(precisions)
    curves: dict[str, list[float]] = {}
    for precision in precisions:
        net = make_model()
        losses = []
        if precision == "fp16":
            trainer = Fp16MasterWeights(
                net, lambda m: _default_optimizer(m, lr), DynamicLossScaler(init_scale=2.0**12)
            )
            for batch in batches:
                loss = loss_fn(trainer.model, batch)
                trainer.backward_and_step(loss)
                losses.append(loss.item())
        else:
            optimizer = _default_optimizer(net, lr)
            for batch in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = loss_fn(net, batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        curves[precision] = losses
    return curves


def _check(precisions) -> None:
    unknown = set(precisions) - set(PRECISIONS)
    if unknown:
        raise ValueError(f"unknown precisions {sorted(unknown)}: use some of {PRECISIONS}")


def step_time(
    make_model: Callable[[], nn.Module],
    batch,
    steps: int = 5,
    precisions: tuple[str, ...] = PRECISIONS,
    loss_fn: Callable[[nn.Module, object], torch.Tensor] = default_loss,
    threads: int | None = 1,
) -> dict[str, float]:
    """Fastest training-step time (seconds) on ``batch`` per precision (forward, backward, AdamW step).

    The precisions alternate step by step, so a neighbour's load hits them alike: read the
    ratios. One warm-up round is not timed. ``threads`` torch threads (restored afterwards).
    """
    _check(precisions)
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        nets = {p: make_model() for p in precisions}
        optimizers = {p: _default_optimizer(nets[p], 1e-4) for p in precisions if p != "fp16"}
        fp16 = (
            Fp16MasterWeights(nets["fp16"], lambda m: _default_optimizer(m, 1e-4))
            if "fp16" in precisions
            else None
        )
        best = {p: float("inf") for p in precisions}
        for round_index in range(steps + 1):
            for precision in precisions:
                start = time.perf_counter()
                if fp16 is not None and precision == "fp16":
                    fp16.backward_and_step(loss_fn(fp16.model, batch))
                else:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                        loss = loss_fn(nets[precision], batch)
                    optimizers[precision].zero_grad(set_to_none=True)
                    loss.backward()
                    optimizers[precision].step()
                if round_index > 0:
                    best[precision] = min(best[precision], time.perf_counter() - start)
        return best
    finally:
        torch.set_num_threads(previous)


def state_bytes(
    make_model: Callable[[], nn.Module],
    batch,
    loss_fn: Callable[[nn.Module, object], torch.Tensor] = default_loss,
) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients and AdamW state after one step on ``batch``, per precision.

    Measured from the tensors that exist after a step with the gradients still in place (for
    fp16: the fp16 model's and the fp32 master's). Activations are not counted.
    """
    out = {}
    for precision in ("fp32", "bf16 autocast"):
        net = make_model()
        optimizer = _default_optimizer(net, 1e-4)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            loss = loss_fn(net, batch)
        loss.backward()
        optimizer.step()
        params = list(net.parameters())
        out[precision] = _parts(tensor_bytes(params), tensor_bytes(p.grad for p in params), optimizer)
    trainer = Fp16MasterWeights(
        make_model(), lambda m: _default_optimizer(m, 1e-4), DynamicLossScaler(2.0**8)
    )
    trainer.scaler.scale_loss(loss_fn(trainer.model, batch).float()).backward()
    for half, master in trainer._pairs:  # the moment both gradient copies exist
        master.grad = None if half.grad is None else half.grad.float()
    grads = tensor_bytes(h.grad for h, _ in trainer._pairs) + tensor_bytes(m.grad for _, m in trainer._pairs)
    if not trainer.scaler.step(trainer.optimizer):
        raise RuntimeError("the fp16 step overflowed at loss scale 256: no optimiser state to measure")
    params = tensor_bytes(trainer.model.parameters()) + tensor_bytes(trainer.master.parameters())
    out["fp16 + fp32 master"] = _parts(params, grads, trainer.optimizer)
    return out


def _parts(params: int, grads: int, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    state = _optimizer_state_bytes(optimizer)
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}
