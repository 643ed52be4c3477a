"""The swarm's client: embeddings and head here, every block on the servers.

``Client(swarm)`` holds what every step needs and is small (the word table, tied to the head,
and the final norm) and sends hidden states along a route of servers (``routing``). Two paths:

- inference: ``generate`` opens an ``InferenceSession`` (``failover``): a KV cache on every
  server of the route, and the history of what each was sent, replayed if one dies;
- training: ``forward`` / ``lm_forward`` run the blocks as autograd nodes (``adapters``), the
  LoRA matrices and soft prompts staying here; a failed hop is routed again from the same block.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models import decoder, generate, shards
from minidist.models.transformer import Embeddings
from minidist.serve.swarm.adapters import _check_adapters, _flatten, _RemoteBlocks, _select
from minidist.serve.swarm.failover import InferenceSession
from minidist.serve.swarm.routing import Hop, plan_route
from minidist.serve.swarm.servers import ServerFailed, Swarm

__all__ = ["Client"]


class Client:
    """Embeddings, final norm and head (tied word table) on this side; blocks on the swarm's servers.

    ``route()``            the chain of alive servers for blocks 0..L-1 (``plan_route``)
    ``generate(ids, n)``   greedy, with KV-cached inference sessions (``use_cache=True``) or by
                           resending the whole sequence every step; fails over (``failover``)
    ``forward(...)``       differentiable, for training adapters and prompts (``adapters``)
    ``failovers``          what happened: one dict per server the client had to route around
    """

    def __init__(self, swarm: Swarm, device: str | torch.device = "cpu") -> None:
        self.swarm = swarm
        self.cfg = cfg = swarm.config
        self.device = torch.device(device)
        with torch.device("meta"):
            self.embeddings = Embeddings(cfg)
            self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if cfg.pre_ln else None
        for module, prefix in (
            (self.embeddings, "transformer.embeddings."),
            (self.final_norm, "transformer.final_norm."),
        ):
            if module is None:
                continue
            tensors = shards.load_tensors(swarm.directory, prefix=prefix, device=self.device)
            module.load_state_dict(
                {n[len(prefix) :]: t for n, t in tensors.items()}, strict=True, assign=True
            )
            module.requires_grad_(False).eval()
        self.failovers: list[dict] = []
        self._session_ids = itertools.count()

    # --- local parts -----------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, past_len: int = 0) -> torch.Tensor:
        """Word vectors (+ learned positions past_len..): the states entering block 0."""
        return generate.embed(self.embeddings, input_ids.to(self.device), past_len)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and the tied head: (B, T, d) -> (B, T, V)."""
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return F.linear(hidden, self.embeddings.word.weight)

    def route(self, start: int = 0, end: int | None = None) -> list[Hop]:
        """The fewest-hop chain of alive servers for blocks start..end-1 (all blocks by default)."""
        return plan_route(self.swarm.alive_spans(), start, self.cfg.n_layers if end is None else end)

    def _record(self, error: ServerFailed, blocks: tuple[int, int], during: str) -> None:
        self.failovers.append(
            {"server": error.server, "blocks": blocks, "reason": error.reason, "during": during}
        )

    # --- training path ---------------------------------------------------------------------
    def forward(
        self, hidden: torch.Tensor, adapters: dict | None = None, prompts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """All blocks over ``hidden`` (B, T, d) through the swarm, differentiable (see ``adapters``).

        ``prompts`` (P, d) or (B, P, d) are prepended; returns (B, P + T, d), before the final norm.
        """
        if hidden.dim() != 3 or hidden.shape[-1] != self.cfg.hidden_size:
            raise ValueError(
                f"hidden must be (batch, seq, {self.cfg.hidden_size}), got {tuple(hidden.shape)}"
            )
        adapters = _check_adapters(adapters, self.cfg.n_layers)
        if prompts is not None:
            if prompts.dim() == 2:
                prompts = prompts.expand(hidden.shape[0], -1, -1)
            if (
                prompts.dim() != 3
                or prompts.shape[0] != hidden.shape[0]
                or prompts.shape[-1] != hidden.shape[-1]
            ):
                raise ValueError(
                    f"prompts must be (P, {hidden.shape[-1]}) or ({hidden.shape[0]}, P, {hidden.shape[-1]}), "
                    f"got {tuple(prompts.shape)}"
                )
            hidden = torch.cat([prompts.to(hidden.dtype), hidden], dim=1)
        scale = float(adapters["scale"]) if adapters else 1.0
        pos, failures = 0, 0
        while pos < self.cfg.n_layers:
            hop = self.route(pos)[0]
            keys, tensors = _flatten(_select(adapters, hop.start, hop.end))
            try:
                hidden = _RemoteBlocks.apply(self, hop, keys, scale, hidden, *tensors)
            except ServerFailed as error:  # route again from the same block, around the dead server
                self._record(error, (hop.start, hop.end), "forward")
                failures += 1
                if failures > len(self.swarm):
                    raise
                continue
            pos = hop.end
        return hidden

    def _backward_blocks(self, hop: Hop, hidden: torch.Tensor, grad_out: torch.Tensor, adapters: dict | None):
        """Gradients of blocks hop.start..hop.end-1 at ``hidden``: (grad_hidden, grad_adapters).

        Normally one backward request to the hop's server. If it died, the blocks are routed over
        other servers: forward through all but the last to get each one's input, then backward
        through them in reverse, summing the adapter gradients (each block's come from one server).
        """
        failures = 0
        chain = [hop]
        while True:
            try:
                inputs = [hidden]
                for h in chain[:-1]:
                    inputs.append(
                        self.swarm.request(
                            h.server,
                            "forward",
                            hidden=inputs[-1],
                            blocks=(h.start, h.end),
                            adapters=_select(adapters, h.start, h.end),
                        )
                    )
                grad, grad_adapters = grad_out, {}
                for h, x in zip(reversed(chain), reversed(inputs)):
                    answer = self.swarm.request(
                        h.server,
                        "backward",
                        hidden=x,
                        grad_out=grad,
                        blocks=(h.start, h.end),
                        adapters=_select(adapters, h.start, h.end),
                    )
                    grad = answer["hidden"]
                    grad_adapters.update(answer["adapters"])
                return grad, grad_adapters
            except ServerFailed as error:
                self._record(error, (hop.start, hop.end), "backward")
                failures += 1
                if failures > len(self.swarm):
                    raise
                chain = self.route(hop.start, hop.end)

    def lm_forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        adapters: dict | None = None,
        prompts: torch.Tensor | None = None,
    ) -> decoder.CausalLMOutput:
        """``DecoderLM(input_ids, labels)`` through the swarm, with LoRA ``adapters`` and soft ``prompts``.

        The prompt (P, d) is prepended to the *word* vectors; learned positions then cover all
        P + T positions (as ``lora.prompt_forward``). Logits are (B, P + T, V); the loss ignores
        the prompt positions' targets (the last prompt vector predicts the first token).
        """
        input_ids = input_ids.to(self.device)
        if prompts is None:
            hidden = self.embed(input_ids)
        else:
            emb, n_prompt = self.embeddings, prompts.shape[-2]
            x = emb.word(input_ids)
            prompts = prompts.expand(x.shape[0], -1, -1) if prompts.dim() == 2 else prompts
            x = torch.cat([prompts.to(x.dtype), x], dim=1)
            if emb.position is not None:
                if x.shape[1] > self.cfg.max_positions:
                    raise ValueError(
                        f"{n_prompt} prompt vectors + {input_ids.shape[1]} tokens = {x.shape[1]} positions, "
                        f"the model has {self.cfg.max_positions}: shorten the input or the prompt"
                    )
                x = x + emb.position(torch.arange(x.shape[1], device=x.device))[None]
            hidden = emb.norm(x) if emb.norm is not None else x
        logits = self.logits(self.forward(hidden, adapters))
        loss = None
        if labels is not None:
            decoder.check_labels(input_ids, labels)
            if prompts is not None:
                pad = labels.new_full((labels.shape[0], prompts.shape[-2]), decoder.IGNORE_INDEX)
                labels = torch.cat([pad, labels.to(pad.device)], dim=1)
            loss = decoder.next_token_loss(logits, labels.to(logits.device))
        return decoder.CausalLMOutput(loss, logits)

    # --- inference path --------------------------------------------------------------------
    def inference_session(self, adapters: dict | None = None) -> InferenceSession:
        """A KV-cached session over the current route (``with client.inference_session() as s:``)."""
        return InferenceSession(self, _check_adapters(adapters, self.cfg.n_layers))

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        use_cache: bool = True,
        adapters: dict | None = None,
        on_token: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Greedy decoding through the swarm; equal, token for token, to ``generate.generate``.

        ``use_cache=True`` sends the prompt once and then one position per step into an inference
        session; ``False`` sends the whole sequence every step (stateless ``forward``).
        ``on_token(t, ids)`` is called after the t-th new token (e.g. to kill a server for a demo).
        """
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(
                f"input_ids must be (batch, prompt_len >= 1), got shape {tuple(input_ids.shape)}"
            )
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        total = input_ids.shape[1] + max_new_tokens
        if self.cfg.position == "learned" and total > self.cfg.max_positions:
            raise ValueError(
                f"prompt of {input_ids.shape[1]} + {max_new_tokens} new tokens = {total} positions, but the "
                f"model has {self.cfg.max_positions}: shorten the prompt or ask for fewer tokens"
            )
        ids = input_ids.to(self.device)
        session = self.inference_session(adapters) if use_cache else None
        try:
            new_ids = ids
            for t in range(max_new_tokens):
                if session is not None:
                    out = session.step(self.embed(new_ids, session.length))
                else:
                    out = self.forward(self.embed(ids), adapters)
                next_id = self.logits(out)[:, -1].argmax(dim=-1)
                new_ids = next_id[:, None]
                ids = torch.cat([ids, new_ids], dim=1)
                if on_token is not None:
                    on_token(t + 1, ids)
        finally:
            if session is not None:
                session.close()
        return ids
