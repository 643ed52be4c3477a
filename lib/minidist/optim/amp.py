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

Memory per parameter with Adam (bytes; measured by ``state_bytes``):

    fp32 / bf16 autocast   params 4   grads 4       Adam 8   = 16
    fp16 + fp32 master     params 2+4 grads 2+4     Adam 8   = 20   (activations halved)
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from torch import nn

from minidist.optim.groups import param_groups
from minidist.optim.loss_scaling import DynamicLossScaler

__all__ = [
    "PRECISIONS",
    "Fp16MasterWeights",
    "bert_batches",
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


def bert_batches(
    batch: int, seq: int, steps: int, seed: int = 0, source: str = "course"
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` masked batches (input_ids, labels) of ``batch`` x ``seq`` tokens.

    ``source="course"``: the course's 128-token train blocks (``minidist.data.mlm_dataset``)
    cut to their first ``seq`` tokens, masked by ``mask_tokens`` (loads the tokenizer, ~3 s).
    ``source="random"``: uniform random token ids after a [CLS], 15% of positions replaced by
    [MASK] and labelled -- no tokenizer, for tests that only need the arithmetic.
    """
    if not 2 <= seq <= 128:
        raise ValueError(f"seq must be in [2, 128] (BERT's course configs have 128 positions), got {seq}")
    gen = torch.Generator().manual_seed(seed)
    out = []
    if source == "random":
        from minidist.models import bert

        for _ in range(steps):
            ids = torch.randint(5, bert.COURSE_VOCAB, (batch, seq), generator=gen)
            ids[:, 0] = 2  # [CLS]
            chosen = torch.rand(batch, seq, generator=gen) < 0.15
            chosen[:, 0] = False
            chosen[0, 1] = True  # at least one label per batch
            labels = torch.where(chosen, ids, torch.full_like(ids, bert.IGNORE_INDEX))
            out.append((ids.masked_fill(chosen, 4), labels))  # 4 = [MASK]
        return out
    if source != "course":
        raise ValueError(f"unknown source {source!r}: use 'course' or 'random'")
    from minidist import data

    tok = data.load_tokenizer()
    blocks = data.mlm_dataset(tok, 128, "train")
    for _ in range(steps):
        rows = torch.randint(len(blocks), (batch,), generator=gen)
        out.append(tuple(data.mask_tokens(blocks[rows, :seq], tok, gen)))
    return out


def _bert(model: str, seed: int) -> nn.Module:
    from minidist.models import bert

    torch.manual_seed(seed)
    return bert.BertForMLM(bert.CONFIGS[model])


def _adamw(module: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(module, 0.01), lr=lr)


def loss_curves(
    model: str = "tiny",
    batch: int = 8,
    seq: int = 32,
    steps: int = 10,
    lr: float = 1e-3,
    precisions: tuple[str, ...] = ("fp32", "bf16"),
    seed: int = 0,
    source: str = "course",
) -> dict[str, list[float]]:
    """Training loss per step of BERT ``model`` from the same initial weights and batches, per precision.

    "fp32": plain; "bf16": forward and loss under ``torch.autocast("cpu", torch.bfloat16)``,
    fp32 weights and optimiser; "fp16": ``Fp16MasterWeights`` with a ``DynamicLossScaler``.
    AdamW, weight decay 0.01 on matrices (``param_groups``), constant ``lr``. ``source``: see
    ``bert_batches``.
    """
    unknown = set(precisions) - set(PRECISIONS)
    if unknown:
        raise ValueError(f"unknown precisions {sorted(unknown)}: use some of {PRECISIONS}")
    batches = bert_batches(batch, seq, steps, seed, source)
    curves: dict[str, list[float]] = {}
    for precision in precisions:
        net = _bert(model, seed)
        losses = []
        if precision == "fp16":
            trainer = Fp16MasterWeights(net, lambda m: _adamw(m, lr), DynamicLossScaler(init_scale=2.0**12))
            for input_ids, labels in batches:
                loss = trainer.model(input_ids, labels=labels).loss
                trainer.backward_and_step(loss)
                losses.append(loss.item())
        else:
            optimizer = _adamw(net, lr)
            for input_ids, labels in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    loss = net(input_ids, labels=labels).loss
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        curves[precision] = losses
    return curves


def step_time(
    model: str = "tiny", batch: int = 8, seq: int = 32, steps: int = 5, threads: int | None = 1
) -> dict[str, float]:
    """Fastest training-step time (seconds) of BERT ``model`` in fp32 and under bf16 autocast (and fp16).

    The precisions alternate step by step, so a neighbour's load hits them alike; report ratios.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        (input_ids, labels), *_ = bert_batches(batch, seq, 1)
        nets = {p: _bert(model, 0) for p in PRECISIONS}
        optimizers = {p: _adamw(nets[p], 1e-4) for p in ("fp32", "bf16")}
        fp16 = Fp16MasterWeights(nets["fp16"], lambda m: _adamw(m, 1e-4))
        best = {p: float("inf") for p in PRECISIONS}
        for _ in range(steps + 1):  # the first round warms up
            for precision in PRECISIONS:
                start = time.perf_counter()
                if precision == "fp16":
                    fp16.backward_and_step(fp16.model(input_ids, labels=labels).loss)
                else:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                        loss = nets[precision](input_ids, labels=labels).loss
                    optimizers[precision].zero_grad(set_to_none=True)
                    loss.backward()
                    optimizers[precision].step()
                seconds = time.perf_counter() - start
                if _ > 0:
                    best[precision] = min(best[precision], seconds)
        return best
    finally:
        torch.set_num_threads(previous)


def state_bytes(model: str = "tiny") -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients and Adam state of BERT ``model`` after one step, per precision.

    Measured from the tensors that exist after a step, gradients still in place (for fp16: the
    fp16 model's and the fp32 master's). Activations are not counted.
    """
    (input_ids, labels), *_ = bert_batches(2, 16, 1, source="random")
    out = {}
    for precision in ("fp32", "bf16 autocast"):
        net = _bert(model, 0)
        optimizer = _adamw(net, 1e-4)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "fp32"):
            loss = net(input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        params = list(net.parameters())
        out[precision] = _parts(tensor_bytes(params), tensor_bytes(p.grad for p in params), optimizer)
    trainer = Fp16MasterWeights(_bert(model, 0), lambda m: _adamw(m, 1e-4), DynamicLossScaler(2.0**8))
    loss = trainer.model(input_ids, labels=labels).loss
    trainer.scaler.scale_loss(loss.float()).backward()
    for half, master in trainer._pairs:  # the moment both gradient copies exist
        master.grad = half.grad.float()
    grads = tensor_bytes(h.grad for h, _ in trainer._pairs) + tensor_bytes(m.grad for _, m in trainer._pairs)
    if not trainer.scaler.step(trainer.optimizer):
        raise RuntimeError("the fp16 step overflowed at loss scale 256: no optimiser state to measure")
    params = tensor_bytes(trainer.model.parameters()) + tensor_bytes(trainer.master.parameters())
    out["fp16 + fp32 master"] = _parts(params, grads, trainer.optimizer)
    return out


def _parts(params: int, grads: int, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    state = _optimizer_state_bytes(optimizer)
    return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}
