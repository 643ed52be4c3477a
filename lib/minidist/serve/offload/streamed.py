"""The streamed model: a decoder whose blocks are read from the shards just in time, then released.

How "release" works, and how we know it does: ``safe_open`` memory-maps the shard file and
``shards.load_block`` builds the block on the meta device and *assigns* the mapped tensors (no
copy). Reading a weight faults its pages in, and from then on they count in the process's
resident set (RSS) like any allocation. When the last reference to a block's tensors goes away,
torch unmaps the file and those pages leave the RSS at once (the data stays in the kernel's page
cache, which is not the process's memory). So releasing a block means dropping every reference:
the loop's variable, the loader thread's variable (``loader``), and -- the easy one to miss --
autograd: a forward pass that records a graph keeps every weight it used alive until backward,
and the whole model would end up resident. Everything here runs under
``torch.inference_mode()``. The tests count live blocks with weak references and measure the
RSS in a child process (``measure``).

Generation keeps the KV cache resident (it is small: 2 · L · T · d numbers per sequence) and
streams every block at every step: each new token reads the whole model from disk again. That is
the price of a small budget (``budget``): throughput is bounded by the disk (or page cache)
bandwidth divided by the model size, tokens/s ≈ bandwidth / bytes -- which is why real systems
(FlexGen, DeepSpeed-Inference's ZeRO-Inference) batch many sequences per pass over the weights.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from minidist.models import generate as gen
from minidist.models import shards
from minidist.models.transformer import Embeddings, TransformerConfig, attention_bias
from minidist.serve.offload.budget import EMBEDDINGS_PREFIX, FINAL_NORM_PREFIX
from minidist.serve.offload.loader import _Loader, _touch_pages

__all__ = ["BlockLoadError", "StreamedDecoder"]


class BlockLoadError(RuntimeError):
    """Reading block ``index`` from the shards failed (in the loader thread or in the caller)."""

    def __init__(self, index: int, directory: Path, cause: BaseException) -> None:
        super().__init__(f"could not load block {index} from {directory}: {type(cause).__name__}: {cause}")
        self.index = index


class StreamedDecoder:
    """A ``DecoderLM`` read from shards with only the embeddings resident and the blocks streamed.

    ``forward(input_ids)`` returns the logits of ``DecoderLM(input_ids).logits`` (the same
    operations in the same order: equal bit for bit); ``generate(ids, n)`` is greedy decoding with a
    KV cache, token for token ``generate.generate``'s. ``prefetch`` reads the next block on a
    daemon thread while the current one computes. ``dtype`` converts each block after reading
    (e.g. bf16 shards computed in fp32); ``device`` ("cuda") copies each block there, so the GPU
    holds at most two blocks plus the resident part and the cache.

    ``max_live_blocks`` is the most blocks that existed at once (counted with weak references),
    ``blocks_read`` how many block reads happened. Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        prefetch: bool = True,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        load_timeout: float = 120.0,
    ) -> None:
        self.directory = Path(directory)
        index = shards.read_index(self.directory)
        missing = [f for f in index.files if not (self.directory / f).exists()]
        if missing:
            raise FileNotFoundError(
                f"{self.directory}: shards {missing} named in {shards.INDEX_NAME} are missing: "
                "the checkpoint is incomplete (copy the whole directory, or save it again)"
            )
        self.cfg: TransformerConfig = index.config
        self.n_layers = self.cfg.n_layers
        self.prefetch = prefetch
        self.dtype = dtype
        self.device = torch.device(device)
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self.max_live_blocks = 0
        self.blocks_read = 0

        # The resident part, built on meta and given the stored tensors (no copy, then moved/cast).
        tensors = shards.load_tensors(self.directory, prefix=EMBEDDINGS_PREFIX)
        with torch.device("meta"):
            self.embeddings = Embeddings(self.cfg)
            self.final_norm = nn.LayerNorm(self.cfg.hidden_size, eps=self.cfg.layer_norm_eps)
        self.embeddings.load_state_dict(
            {n[len(EMBEDDINGS_PREFIX) :]: t for n, t in tensors.items()}, strict=True, assign=True
        )
        tensors = shards.load_tensors(self.directory, prefix=FINAL_NORM_PREFIX)
        self.final_norm.load_state_dict(
            {n[len(FINAL_NORM_PREFIX) :]: t for n, t in tensors.items()}, strict=True, assign=True
        )
        del tensors
        for part in (self.embeddings, self.final_norm):
            part.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
            _touch_pages(part)
        # The thread holds the model weakly, so a model dropped without close() is collected,
        # and its __del__ stops the thread.
        self._loader = _Loader(weakref.WeakMethod(self._read_block), load_timeout) if prefetch else None
        self._closed = False

    # -- reading and releasing blocks ----------------------------------------------------------
    @property
    def word_embeddings(self) -> torch.Tensor:
        """The (V, d) word table, also the output matrix (tied)."""
        return self.embeddings.word.weight

    def _read_block(self, i: int) -> nn.Module:
        """Block i from its shard, on ``device`` in ``dtype``, its pages read (any thread)."""
        try:
            block = shards.load_block(self.directory, i)
            if self.dtype is not None or self.device.type != "cpu":
                block = block.to(device=self.device, dtype=self.dtype)  # a copy; the mapping goes
            block.eval().requires_grad_(False)
            _touch_pages(block)
        except Exception as e:
            raise BlockLoadError(i, self.directory, e) from e
        with self._lock:
            self._live.add(block)
            self.blocks_read += 1
            self.max_live_blocks = max(self.max_live_blocks, len(self._live))
        return block

    def live_blocks(self) -> int:
        """Blocks that exist right now (0 between passes: all were released)."""
        with self._lock:
            return len(self._live)

    def _run_blocks(self, apply) -> None:
        """Call ``apply(i, block)`` for blocks 0..L-1 in order, each read just in time, then released."""
        if self._closed:
            raise RuntimeError("this StreamedDecoder is closed: build a new one")
        loader = self._loader
        if loader is not None:
            loader.submit(0)
        try:
            for i in range(self.n_layers):
                block = loader.result(i) if loader is not None else self._read_block(i)
                if loader is not None and i + 1 < self.n_layers:
                    loader.submit(i + 1)  # read the next block while this one computes
                apply(i, block)
                del block  # the last reference: the shard's pages leave the process
        finally:
            if loader is not None:
                loader.discard()  # an interrupted pass leaves no block behind

    def close(self) -> None:
        """Stop the loader thread (idempotent); the model cannot run afterwards."""
        self._closed = True
        if getattr(self, "_loader", None) is not None:
            self._loader.close()

    def __enter__(self) -> StreamedDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- the model ----------------------------------------------------------------------------
    def _check_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
        return input_ids.to(self.device)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.final_norm(hidden), self.word_embeddings)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of the whole sequence, as ``DecoderLM(input_ids).logits``."""
        input_ids = self._check_ids(input_ids)
        hidden = self.embeddings(input_ids)
        bias = attention_bias(self.cfg, input_ids.shape[1], attention_mask, hidden.dtype, hidden.device)

        def apply(i: int, block: nn.Module) -> None:
            nonlocal hidden
            hidden = block(hidden, bias)

        self._run_blocks(apply)
        return self._head(hidden)

    __call__ = forward

    @torch.inference_mode()
    def step(self, new_ids: torch.Tensor, cache: gen.KVCache, past_len: int) -> torch.Tensor:
        """Run ``new_ids`` (B, T_new) at positions past_len.. against ``cache``; logits (B, T_new, V).

        The cache (one entry per block) stays resident; the blocks stream as in ``forward``.
        """
        new_ids = self._check_ids(new_ids)
        if len(cache) != self.n_layers:
            raise ValueError(
                f"cache has {len(cache)} layers, the model {self.n_layers}: use KVCache(n_layers)"
            )
        if past_len != cache.length:
            raise ValueError(
                f"the cache holds {cache.length} positions but past_len is {past_len}: pass "
                "past_len=cache.length (the positions already run), or start a fresh KVCache"
            )
        hidden = gen.embed(self.embeddings, new_ids, past_len)
        bias = gen.step_bias(self.cfg, past_len, new_ids.shape[1], hidden.dtype, hidden.device)

        def apply(i: int, block: nn.Module) -> None:
            # generate.span_step for a span of one block: the cache entry stays, the block goes
            nonlocal hidden
            hidden, cache[i] = gen.block_step(block, hidden, cache[i], bias)

        self._run_blocks(apply)
        return self._head(hidden)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding with a KV cache: input_ids followed by ``max_new_tokens`` tokens.

        One streamed pass for the prompt (which fills the cache), then one pass per new token.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        ids = self._check_ids(input_ids)
        total = ids.shape[1] + max_new_tokens
        if self.cfg.position == "learned" and total > self.cfg.max_positions:
            raise ValueError(
                f"{ids.shape[1]} prompt tokens + {max_new_tokens} new = {total} positions, but the model "
                f"has {self.cfg.max_positions}: shorten the prompt or ask for fewer tokens"
            )
        if max_new_tokens == 0:
            return ids
        cache = gen.KVCache(self.n_layers)
        logits = self.step(ids, cache, 0)
        for _ in range(max_new_tokens):
            next_id = logits[:, -1].argmax(dim=-1, keepdim=True)
            past_len = ids.shape[1]
            ids = torch.cat([ids, next_id], dim=1)
            if ids.shape[1] == total:
                break
            logits = self.step(next_id, cache, past_len)
        return ids
