"""Dynamic loss scaling for fp16 training, written from scratch (Micikevicius et al., 2018).

fp16 holds magnitudes from about 6e-8 (smallest subnormal) to 65504. Many gradients of a
network are smaller than 6e-8 and would flush to zero in fp16; multiplying the *loss* by a
scale S multiplies every gradient by S (the chain rule is linear) and lifts them into range.
Before the optimiser sees them they are divided by S again -- in fp32, where nothing is lost.

S is chosen on the fly: too large and some gradient overflows to inf (or a nan appears);
then the step is *skipped* (weights and optimiser state untouched) and S shrinks. After
``growth_interval`` clean steps in a row S grows again, to probe for the largest safe scale:

    step:    1   2   3   4   5   6   7   8 ...          growth_interval = 3
    grads:   ok  ok  ok  inf ok  ok  ok  ok
    S:       S   S   2S  S   S   S   2S  2S        (S after the step; backoff 0.5, growth 2)
             └ 3 clean ┘ │skip └─ 3 clean ┘

This is the rule of ``torch.amp.GradScaler`` (same constants, same sequence -- tested).

Use with any optimiser whose parameters hold the gradients to unscale:

    scaler = DynamicLossScaler()
    scaler.scale_loss(loss).backward()
    stepped = scaler.step(optimizer, params)      # unscale, check, step or skip, update S
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """The loss scale S and its update rule; ``history`` lists (scale used, found_inf) per step."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(
                "need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1; got "
                f"{init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0  # consecutive steps without inf/nan since the last change of scale
        self.history: list[tuple[float, bool]] = []

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss · S`` (call ``.backward()`` on it)."""
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every ``.grad`` by S in place; return True if any gradient holds inf or nan.

        The check runs on the unscaled values; an fp16 gradient is divided in its own dtype, so
        pass fp32 (master) gradients where the small values matter.
        """
        found_inf = False
        inv_scale = 1.0 / self.scale
        for p in params:
            if p.grad is None:
                continue
            p.grad.mul_(inv_scale)
            found_inf = found_inf or not bool(torch.isfinite(p.grad).all())
        return found_inf

    def update(self, found_inf: bool) -> None:
        """Shrink S by ``backoff_factor`` after an overflow; grow it after ``growth_interval`` clean steps."""
        self.history.append((self.scale, found_inf))
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None) -> bool:
        """Unscale the gradients of ``params`` (default: the optimiser's), step unless inf/nan, update S.

        Returns True if the optimiser stepped, False if the step was skipped.
        """
        if params is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
        found_inf = self.unscale_(params)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
