"""Adapters on the client, blocks on the servers: a hop of the swarm as an autograd node.

``client.forward(hidden, adapters, prompts)`` is differentiable. Each hop is a
``torch.autograd.Function`` (``_RemoteBlocks``): forward sends ``hidden`` (and the hop's LoRA
matrices) for a stateless forward; backward sends ``hidden`` and the output's gradient, and the
server *recomputes* its blocks with autograd and returns the gradients w.r.t. ``hidden`` and the
LoRA matrices (Petals does the same: a server keeps no activations between requests). The blocks
stay frozen; the adapters live on the client and travel with every request::

    adapters = {block index: {"query": (A, B), "value": (A, B)}, ..., "scale": s}
    #   A (r, d_in), B (d_out, r); the projection's output gets  s · (x Aᵀ) Bᵀ   (lora.lora_delta)
    client.forward(hidden (B, T, d), adapters=None, prompts=None) -> (B, P + T, d)
    #   prompts (P, d) or (B, P, d) are prepended to hidden; the result is the last block's output
    #   (before the final norm) for all P + T positions; gradients reach hidden, prompts, A and B
    client.lm_forward(input_ids, labels=None, adapters=None, prompts=None) -> CausalLMOutput
    #   embeddings (the prompt prepended before positions, as lora.prompt_forward), forward, head, loss

An autograd Function takes and returns tensors, not dicts: ``_flatten`` lays the adapters out as
a list ``[A, B, A, B, ...]`` with their keys beside it, ``_unflatten`` builds the dict back on
the other side. ``_select`` cuts out what one hop needs. The client (``client``) calls these;
the backward request, with its failover, is ``Client._backward_blocks``.
"""

from __future__ import annotations

import torch

from minidist.serve import _server


def _check_adapters(adapters: dict | None, n_layers: int) -> dict | None:
    if not adapters:
        return None
    if "scale" not in adapters:
        raise ValueError(
            'adapters need a "scale" entry (alpha / rank), e.g. {0: {"query": (A, B)}, "scale": 2.0}'
        )
    for key, targets in adapters.items():
        if key == "scale":
            continue
        if not isinstance(key, int) or not 0 <= key < n_layers:
            raise ValueError(f"adapter key {key!r}: use block indices 0..{n_layers - 1} (and 'scale')")
        for target, pair in targets.items():
            if target not in _server.LORA_TARGETS or len(pair) != 2:
                raise ValueError(
                    f"adapters[{key}][{target!r}]: give (A, B) for one of {_server.LORA_TARGETS}"
                )
    return adapters


def _select(adapters: dict | None, start: int, end: int) -> dict | None:
    """The adapters of blocks start..end-1 (what one hop needs), or None."""
    if not adapters:
        return None
    chosen = {k: v for k, v in adapters.items() if k != "scale" and start <= k < end}
    return {**chosen, "scale": float(adapters["scale"])} if chosen else None


def _flatten(adapters: dict | None) -> tuple[list[tuple[int, str]], list[torch.Tensor]]:
    keys, tensors = [], []
    for key, targets in (adapters or {}).items():
        if key == "scale":
            continue
        for target, (A, B) in targets.items():
            keys.append((key, target))
            tensors += [A, B]
    return keys, tensors


def _unflatten(keys: list[tuple[int, str]], scale: float, tensors) -> dict | None:
    if not keys:
        return None
    out: dict = {"scale": scale}
    for k, (key, target) in enumerate(keys):
        out.setdefault(key, {})[target] = (tensors[2 * k], tensors[2 * k + 1])
    return out


class _RemoteBlocks(torch.autograd.Function):
    """One hop as an autograd node: forward on the server, backward by the server's recomputation."""

    @staticmethod
    def forward(ctx, client, hop, keys, scale, hidden, *adapter_tensors):  # noqa: ANN001, ANN205
        adapters = _unflatten(keys, scale, [t.detach() for t in adapter_tensors])
        out = client.swarm.request(
            hop.server, "forward", hidden=hidden.detach(), blocks=(hop.start, hop.end), adapters=adapters
        )
        ctx.client, ctx.hop, ctx.keys, ctx.scale = client, hop, keys, scale
        ctx.save_for_backward(hidden, *adapter_tensors)
        return out.to(hidden.device)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        hidden, *adapter_tensors = ctx.saved_tensors
        adapters = _unflatten(ctx.keys, ctx.scale, adapter_tensors)
        grad_hidden, grad_adapters = ctx.client._backward_blocks(ctx.hop, hidden, grad_out, adapters)
        flat = []
        for key, target in ctx.keys:
            flat += list(grad_adapters[key][target])
        return (None, None, None, None, grad_hidden.to(hidden.device), *(g.to(hidden.device) for g in flat))
