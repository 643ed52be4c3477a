"""Streamed inference: run a decoder whose weights do not fit in memory, one block at a time.

A 176B model in fp16 is 352 GB; a machine with 64 GB of RAM cannot hold it, yet it can *run*
it: a decoder is a chain of blocks, and block i needs only its own weights and the hidden
states that block i - 1 produced. So keep resident only what every step needs (the word table,
which is also the output matrix, and the final LayerNorm) and stream the blocks from the
safetensors shards (``minidist.models.shards``), each loaded just before it runs and released
right after::

    resident:   embeddings + final norm + head (tied)          ~ V·d
    streamed:   block 0 ─► block 1 ─► block 2 ─► ... ─► block L-1     (12 d² each)

    time ─────────────────────────────────────────────────────────────────────►
    prefetch=False   [read 0][run 0][read 1][run 1][read 2][run 2] ...
    prefetch=True    [read 0][run 0   ][run 1   ][run 2   ] ...         (main thread)
                             [read 1] [read 2] [read 3]     ...         (loader thread)

With ``prefetch=True`` a background thread reads block i + 1 while block i computes, so reading
and computing overlap (the same idea as ZeRO-3's prefetch of the next unit). At most two blocks
are resident: the one computing and the one being read. The loader is asked for block i + 1 only
once block i is in hand, so it never runs further ahead -- a queue alone would not bound this:
a loader blocked on a full queue of depth 1 already holds a third block in its hands.

How "release" works, and how we know it does: ``safe_open`` memory-maps the shard file and
``shards.load_block`` builds the block on the meta device and *assigns* the mapped tensors (no
copy). Reading a weight faults its pages in, and from then on they count in the process's
resident set (RSS) like any allocation. When the last reference to a block's tensors goes away,
torch unmaps the file and those pages leave the RSS at once (the data stays in the kernel's page
cache, which is not the process's memory). So releasing a block means dropping every reference:
the loop's variable, the loader thread's variable, and -- the easy one to miss -- autograd: a
forward pass that records a graph keeps every weight it used alive until backward, and the whole
model would end up resident. Everything here runs under ``torch.inference_mode()``. The tests
count live blocks with weak references and measure the RSS in a child process.

    budget = resident bytes + 2 x largest block                 (budget_bytes(directory))
    peak RSS growth <= budget + what the computation itself needs (activations, the KV cache,
                       the logits: measured on the in-memory model, see measure_streaming)

Generation keeps the KV cache resident (it is small: 2 · L · T · d numbers per sequence) and
streams every block at every step: each new token reads the whole model from disk again. That is
the price of a small budget: throughput is bounded by the disk (or page cache) bandwidth divided
by the model size, tokens/s ≈ bandwidth / bytes -- which is why real systems (FlexGen,
DeepSpeed-Inference's ZeRO-Inference) batch many sequences per pass over the weights.

    with StreamedDecoder(directory) as model:
        logits = model(input_ids)                    # == DecoderLM(input_ids).logits
        ids = model.generate(prompt, max_new_tokens=8)   # == generate.generate(model, ...)
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from minidist.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from minidist.models import generate as gen
from minidist.models import shards
from minidist.models.transformer import Embeddings, TransformerBlock, TransformerConfig, attention_bias

__all__ = [
    "BlockLoadError",
    "StreamedDecoder",
    "budget_bytes",
    "checkpoint_bytes",
    "demo",
    "demo_config",
    "measure_streaming",
    "measure_rss",
    "resident_bytes",
    "block_bytes",
    "write_random_checkpoint",
    "THREAD_SLACK_BYTES",
]

EMBEDDINGS_PREFIX = "transformer.embeddings."
FINAL_NORM_PREFIX = "transformer.final_norm."

# Beside the weights and the computation's own temporaries, streaming adds a little: the index
# parsed at every block read, safetensors' open handles, the loader thread's stack and malloc
# arena. Measured (prefetch peak growth - budget - the in-memory run's compute overhead): 2.0 MB
# for the 53 MB test checkpoint and 2.0 MB for the 1 GB demo. 4 MiB leaves room for allocator noise.
THREAD_SLACK_BYTES = 4 << 20


class BlockLoadError(RuntimeError):
    """Reading block ``index`` from the shards failed (in the loader thread or in the caller)."""

    def __init__(self, index: int, directory: Path, cause: BaseException) -> None:
        super().__init__(f"could not load block {index} from {directory}: {type(cause).__name__}: {cause}")
        self.index = index


# --------------------------------------------------------------------------------------------
# Sizes, read from the shards' headers (no tensor data is read)
# --------------------------------------------------------------------------------------------
# every dtype a safetensors header can name (BOOL is stored as one byte per element)
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


def _dtype_bytes(dtype: str, name: str) -> int:
    """Bytes per element of a safetensors dtype name; a clear error for one we do not know."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(
            f"tensor {name!r} is stored as {dtype!r}, a dtype this reader does not size "
            f"(known: {sorted(_DTYPE_BYTES)}): convert the checkpoint to one of those"
        )
    return _DTYPE_BYTES[dtype]


def _bytes_by_prefix(directory: str | os.PathLike, prefixes: list[str]) -> dict[str, int]:
    """Bytes of the stored tensors under each prefix, from the safetensors headers of the shards."""
    directory = Path(directory)
    index = shards.read_index(directory)
    out = dict.fromkeys(prefixes, 0)
    by_file: dict[str, list[str]] = {}
    for name, file in index.weight_map.items():
        if name.startswith(tuple(prefixes)):
            by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        path = directory / file
        if not path.exists():
            raise FileNotFoundError(
                f"shard {path} named in the index is missing: the checkpoint is incomplete "
                "(copy the whole directory, or write it again with shards.save_sharded)"
            )
        with safe_open(str(path), framework="pt") as f:  # maps the file; reads only the header
            for name in names:
                for prefix in prefixes:
                    if name.startswith(prefix):
                        sl = f.get_slice(name)
                        out[prefix] += math.prod(sl.get_shape()) * _dtype_bytes(sl.get_dtype(), name)
    return out


def block_bytes(directory: str | os.PathLike) -> list[int]:
    """Bytes of each block as stored (one number per block)."""
    cfg = shards.read_index(directory).config
    prefixes = [shards.block_prefix(i) for i in range(cfg.n_layers)]
    sizes = _bytes_by_prefix(directory, prefixes)
    return [sizes[p] for p in prefixes]


def resident_bytes(directory: str | os.PathLike) -> int:
    """Bytes of what stays resident: the embeddings (word table = tied head) and the final norm."""
    sizes = _bytes_by_prefix(directory, [EMBEDDINGS_PREFIX, FINAL_NORM_PREFIX])
    return sum(sizes.values())


def checkpoint_bytes(directory: str | os.PathLike) -> int:
    """Bytes of the checkpoint's files on disk (shards and index)."""
    return sum(p.stat().st_size for p in Path(directory).iterdir() if p.is_file())


def budget_bytes(directory: str | os.PathLike) -> int:
    """Weights resident at the peak of a streamed pass: the resident part + the 2 largest blocks
    (the one computing and the one being prefetched; without prefetch one block suffices).

    (As stored; a ``dtype`` given to ``StreamedDecoder`` converts after reading, so the block
    as stored and its converted copy briefly coexist.)
    """
    blocks = sorted(block_bytes(directory), reverse=True)
    return resident_bytes(directory) + sum(blocks[:2])


# --------------------------------------------------------------------------------------------
# The loader thread
# --------------------------------------------------------------------------------------------
def _touch_pages(module: nn.Module) -> None:
    """Read one byte of every page of every weight, so the pages are in memory before the compute.

    The tensors are mapped from the shard: reading a page the first time is a page fault that
    brings it in (from the page cache, or from the disk). One byte per page is enough: the kernel
    maps whole pages. This is the "read" that prefetching moves to the loader thread.
    """
    page = 4096
    for t in module.state_dict().values():
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1).view(torch.uint8)
        flat[::page].sum()
        flat[-1:].sum()


class _Loader:
    """A daemon thread that reads blocks on request: ``submit(i)`` then ``result(i)``.

    One request at a time is outstanding (the caller asks for block i + 1 only when it holds
    block i), so at most two blocks exist. Errors travel back with the block index and are
    raised in the caller; the thread keeps serving. Each request carries a serial number, so a
    late answer to a request the caller gave up on (a timeout) is recognised and dropped, never
    taken for a later request's block. ``close()`` stops the thread (idempotent).
    """

    def __init__(self, load: weakref.WeakMethod, timeout: float) -> None:
        self._load = load
        self._timeout = timeout
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._serial = 0
        self._outstanding: int | None = None  # the block index asked for and not yet collected
        self._thread = threading.Thread(target=self._serve, name="minidist-block-loader", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            serial, i = request
            try:
                load = self._load()  # a weak reference: a forgotten model can still be collected
                if load is None:
                    raise RuntimeError("the StreamedDecoder was garbage-collected")
                item = (serial, load(i), None)
                del load
            except BaseException as e:  # carried to the caller, never lost in this thread
                item = (serial, None, e)
            self._results.put(item)
            del item  # else this thread would hold the block until the next request: a third block

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, i: int) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the loader thread has stopped: the StreamedDecoder was closed")
        if self._outstanding is not None:
            raise RuntimeError(f"block {self._outstanding} was requested and not collected")
        self._serial += 1
        self._outstanding = i
        self._requests.put((self._serial, i))

    def result(self, i: int) -> nn.Module:
        """Block ``i`` (waits for it); a failed read raises its ``BlockLoadError`` here."""
        if self._outstanding != i:
            raise RuntimeError(f"block {i} was not requested (outstanding: {self._outstanding})")
        self._outstanding = None
        deadline = time.monotonic() + self._timeout
        while True:
            try:
                serial, block, error = self._results.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError(f"the loader thread stopped before delivering block {i}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"block {i} was not read within {self._timeout:g} s: is the disk that slow? "
                        "pass a larger load_timeout to StreamedDecoder"
                    ) from None
                continue
            if serial != self._serial:
                del block  # the late answer to an abandoned request
                continue
            if error is not None:
                raise error
            return block

    def discard(self) -> None:
        """Collect and drop the outstanding block, if any (after an interrupted pass)."""
        if self._outstanding is not None:
            try:
                self.result(self._outstanding)
            except Exception:
                pass

    def close(self) -> None:
        if self._thread.is_alive():
            self._requests.put(None)
            self._thread.join(timeout=self._timeout)
        self._outstanding = None


# --------------------------------------------------------------------------------------------
# The streamed model
# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# Measurement: peak RSS and tokens/s, each in a fresh child process
# --------------------------------------------------------------------------------------------
def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _warm_up_torch(cfg: TransformerConfig) -> None:
    """Run each kind of operation once on tiny tensors, so torch's lazy set-up (thread pool, kernels'
    first-use tables, the modules a first ``torch.device("meta")`` imports) happens before the
    baseline and is not counted as the model's."""
    with torch.device("meta"):  # the first nn.Embedding built on meta imports ~800 modules (~70 MB)
        Embeddings(cfg), TransformerBlock(cfg)
    x = torch.randn(1, 4, cfg.hidden_size)
    w = torch.randn(cfg.hidden_size, cfg.hidden_size)
    y = F.layer_norm(F.gelu(F.linear(x, w)), (cfg.hidden_size,))
    torch.softmax(y @ y.transpose(-2, -1), dim=-1).argmax()


def _measure_here(
    directory: str,
    mode: str,
    prompt_len: int,
    new_tokens: int,
    batch: int,
    threads: int,
    seed: int,
    repeats: int,
) -> dict:
    """The measurement behind :func:`measure_rss`, in this process (call it in a fresh one).

    ``mode``: "prefetch", "no_prefetch" (StreamedDecoder), "hold" (the control of the release:
    no prefetch, and every block read is kept in a list, as a forgotten reference would keep it)
    or "in_memory" (shards.load_decoder). RSS growth is counted from just before the model is
    built: the weights that become resident, the computation's temporaries, the KV cache and
    (streamed) the loader thread. ``seconds`` is the best of ``repeats`` generations.
    """
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    cfg = shards.read_index(directory).config
    _warm_up_torch(cfg)
    prompt = torch.randint(cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    if not reset_peak_rss():
        return {"error": "cannot reset VmHWM via /proc/self/clear_refs"}
    baseline = rss_bytes()
    out: dict = {"mode": mode}
    times = []
    if mode == "in_memory":
        model = shards.load_decoder(directory).eval().requires_grad_(False)
        for t in model.state_dict().values():  # read the weights in (they are mapped from the shards)
            t.reshape(-1).view(torch.uint8)[::4096].sum()
        out["weights_rss"] = rss_bytes() - baseline
        load_peak = peak_rss_bytes() - baseline
        # What the generation itself needs beyond the weights (activations, logits, KV cache):
        # the "compute overhead" that the streamed runs carry too.
        reset_peak_rss()
        before = rss_bytes()
        for _ in range(repeats):
            start = time.perf_counter()
            ids = gen.generate(model, prompt, new_tokens)
            times.append(time.perf_counter() - start)
        out["compute_overhead"] = peak_rss_bytes() - before
        out["peak_growth"] = max(load_peak, peak_rss_bytes() - baseline)
    elif mode in ("prefetch", "no_prefetch", "hold"):
        with StreamedDecoder(directory, prefetch=mode == "prefetch") as model:
            out["resident_rss"] = rss_bytes() - baseline
            if mode == "hold":
                held, read = [], model._read_block
                model._read_block = lambda i: held.append(read(i)) or held[-1]
            for _ in range(repeats):
                start = time.perf_counter()
                ids = model.generate(prompt, new_tokens)
                times.append(time.perf_counter() - start)
            out["peak_growth"] = peak_rss_bytes() - baseline
            out["max_live_blocks"] = model.max_live_blocks
            out["blocks_read"] = model.blocks_read
            if mode == "hold":
                del held
            out["rss_after_run"] = rss_bytes() - baseline
        out["rss_after_close"] = rss_bytes() - baseline
    else:
        raise ValueError(f'mode must be "prefetch", "no_prefetch", "hold" or "in_memory", got {mode!r}')
    out["seconds"] = min(times)
    out["tokens_per_s"] = batch * new_tokens / out["seconds"]
    out["ids"] = ids.tolist()
    out["baseline_rss"] = baseline
    return out


def _child(task: dict, timeout: float) -> dict:
    """Run ``task`` in ``python -m minidist.serve.offload`` (a fresh process); its JSON answer."""
    proc = subprocess.run(
        [sys.executable, "-m", "minidist.serve.offload", json.dumps(task)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the child process ({task.get('task')}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_rss(
    directory: str | os.PathLike,
    mode: str = "prefetch",
    prompt_len: int = 16,
    new_tokens: int = 8,
    batch: int = 1,
    threads: int = 1,
    seed: int = 0,
    repeats: int = 2,
    timeout: float = 600.0,
) -> dict:
    """One generation run in a fresh child process: its peak RSS growth, tokens/s and the ids.

    ``mode``: "prefetch", "no_prefetch", "hold" (the control: every block kept after use) or
    "in_memory". Returns the child's dict: ``peak_growth`` (VmHWM - RSS before the model was built),
    ``tokens_per_s`` (best of ``repeats``), ``ids``, and per mode ``max_live_blocks``,
    ``resident_rss`` / ``weights_rss``, ``compute_overhead`` (in memory: the peak beyond the weights).
    """
    if mode not in ("prefetch", "no_prefetch", "hold", "in_memory"):
        raise ValueError(f'mode must be "prefetch", "no_prefetch", "hold" or "in_memory", got {mode!r}')
    task = dict(
        task="measure",
        directory=str(directory),
        mode=mode,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        batch=batch,
        threads=threads,
        seed=seed,
        repeats=repeats,
    )
    return _child(task, timeout)


def measure_streaming(
    directory: str | os.PathLike,
    prompt_len: int = 16,
    new_tokens: int = 8,
    batch: int = 1,
    threads: int = 1,
    in_memory: bool | None = None,
    seed: int = 0,
    repeats: int = 2,
    timeout: float = 600.0,
) -> dict:
    """Peak RSS and tokens/s of streamed generation, with and without prefetch, and of the model in memory.

    Each run is a fresh child process (``python -m minidist.serve.offload``), so its peak RSS
    (VmHWM) is the run's own, not the caller's: the growth is counted from just before the model
    is built. The runs generate ``new_tokens`` greedily after a random prompt of ``prompt_len``
    tokens (``batch`` of them); ``threads`` torch threads each (1: the loader thread gets the
    other core).

    ``in_memory`` (default: when the checkpoint takes less than half of the available memory)
    adds the control: ``shards.load_decoder`` and ``generate.generate``. It gives the baseline
    tokens/s and the *compute overhead*: the peak RSS the generation needs beyond the weights
    (activations, logits, KV cache), which the streamed runs need too. The budget then holds when

        streamed peak growth <= budget_bytes + compute_overhead + THREAD_SLACK_BYTES

    Returns ``disk_bytes``, ``budget_bytes``, ``resident_bytes``, ``block_bytes`` (largest),
    ``n_layers``, ``prefetch`` / ``no_prefetch`` / ``in_memory`` (each the child's dict: peak_growth,
    tokens_per_s, ...; ``in_memory`` None if skipped), ``same_output`` (all runs produced the same
    ids), ``overhead_bytes`` (prefetch peak growth - budget), ``streaming_extra_bytes`` (that minus
    the compute overhead: what streaming itself adds, bounded by THREAD_SLACK_BYTES),
    ``speedup_prefetch`` (tokens/s with / without prefetch), ``ratio_vs_in_memory`` (streamed with
    prefetch / in memory). Timings are best of ``repeats``; on a shared machine run it twice.
    Raises RuntimeError with the child's stderr if one fails, TimeoutExpired after ``timeout`` s.
    """
    directory = Path(directory)
    if min(prompt_len, new_tokens, batch, threads) < 1:
        raise ValueError(
            f"prompt_len {prompt_len}, new_tokens {new_tokens}, batch {batch}, threads {threads} must be >= 1"
        )
    cfg = shards.read_index(directory).config
    if cfg.position == "learned" and prompt_len + new_tokens > cfg.max_positions:
        raise ValueError(
            f"prompt_len {prompt_len} + new_tokens {new_tokens} exceeds the model's "
            f"{cfg.max_positions} positions: ask for fewer tokens"
        )
    disk = checkpoint_bytes(directory)
    if in_memory is None:
        available = _available_bytes()
        in_memory = available is not None and disk < available // 2
    common = dict(
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        batch=batch,
        threads=threads,
        seed=seed,
        repeats=repeats,
        timeout=timeout,
    )
    runs = {mode: measure_rss(directory, mode, **common) for mode in ("prefetch", "no_prefetch")}
    runs["in_memory"] = measure_rss(directory, "in_memory", **common) if in_memory else None
    for run in runs.values():
        if run is not None and "error" in run:
            return {"error": run["error"]}
    outputs = [run.pop("ids") for run in runs.values() if run is not None]
    budget = budget_bytes(directory)
    result = {
        "disk_bytes": disk,
        "budget_bytes": budget,
        "resident_bytes": resident_bytes(directory),
        "block_bytes": max(block_bytes(directory)),
        "n_layers": cfg.n_layers,
        **runs,
        "same_output": all(o == outputs[0] for o in outputs),
        "overhead_bytes": runs["prefetch"]["peak_growth"] - budget,
        "speedup_prefetch": runs["prefetch"]["tokens_per_s"] / runs["no_prefetch"]["tokens_per_s"],
        "streaming_extra_bytes": (
            runs["prefetch"]["peak_growth"] - budget - runs["in_memory"]["compute_overhead"]
            if in_memory
            else None
        ),
        "ratio_vs_in_memory": (
            runs["prefetch"]["tokens_per_s"] / runs["in_memory"]["tokens_per_s"] if in_memory else None
        ),
    }
    return result


# --------------------------------------------------------------------------------------------
# The demonstration: a random ~1 GB model run under a budget of about an eighth of it
# --------------------------------------------------------------------------------------------
def demo_config(
    hidden: int = 1024, n_layers: int = 20, vocab: int = 8192, positions: int = 128
) -> TransformerConfig:
    """A decoder config for the demonstration. The default: 20 blocks of 12·1024² + 13·1024 =
    12,596,224 parameters (50.4 MB in fp32 each), an 8192 x 1024 word table (33.6 MB):
    1.04 GB in fp32, against a budget of 33.6 + 2 x 50.4 = 134 MB (7.7x smaller)."""
    return TransformerConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=n_layers,
        n_heads=max(1, hidden // 64),
        max_positions=positions,
        causal=True,
        pre_ln=True,
        embedding_layernorm=False,
        layer_norm_eps=1e-5,
    )


def _write_here(directory: str, config: dict, seed: int, blocks_per_shard: int) -> dict:
    from minidist.models.decoder import DecoderLM

    torch.manual_seed(seed)
    model = DecoderLM(TransformerConfig(**config))
    shards.save_sharded(model, directory, blocks_per_shard=blocks_per_shard)
    return {"directory": directory}


def write_random_checkpoint(
    directory: str | os.PathLike,
    cfg: TransformerConfig,
    seed: int = 0,
    blocks_per_shard: int = 1,
    timeout: float = 600.0,
) -> Path:
    """Write a randomly initialised ``DecoderLM(cfg)`` as shards under ``directory``, built in a child
    process (so a model of several GB never occupies the caller's memory). Returns the directory."""
    import dataclasses

    task = dict(
        task="write",
        directory=str(directory),
        config=dataclasses.asdict(cfg),
        seed=seed,
        blocks_per_shard=blocks_per_shard,
    )
    _child(task, timeout)
    return Path(directory)


def demo(
    cfg: TransformerConfig | None = None,
    directory: str | os.PathLike | None = None,
    keep: bool = False,
    prompt_len: int = 16,
    new_tokens: int = 8,
    seed: int = 0,
    timeout: float = 600.0,
) -> dict:
    """Write a random checkpoint (``demo_config()``: about 1 GB), run it streamed and in memory.

    The checkpoint goes to ``directory / "checkpoint"`` (``directory``: a new temporary directory
    by default; it is created if missing, and a ``checkpoint`` already in it is refused, never
    overwritten). Unless ``keep=True``, afterwards this deletes only what it created: the
    ``checkpoint`` subdirectory (and the temporary directory); anything else in ``directory`` is
    left alone, also when writing failed. Returns :func:`measure_streaming`'s dict plus
    ``directory`` (the checkpoint's path, None once deleted), ``write_s`` and ``times_budget``
    (disk bytes / budget). Costs 40-80 s on two busy cores (measured): writing 1 GB (~30 s),
    then three child processes.
    """
    cfg = cfg or demo_config()
    if directory is None:
        parent = Path(tempfile.mkdtemp(prefix="minidist-streamed-"))
        created = parent  # all ours: delete it whole
    else:
        parent = Path(directory)
        if (parent / "checkpoint").exists():
            raise ValueError(
                f"{parent / 'checkpoint'} already exists: demo() writes its checkpoint there and deletes "
                "it afterwards, so give a directory without a 'checkpoint' entry (or directory=None)"
            )
        parent.mkdir(parents=True, exist_ok=True)
        created = parent / "checkpoint"  # only this is ours
    target = parent / "checkpoint"
    try:
        start = time.perf_counter()
        write_random_checkpoint(target, cfg, seed=seed, timeout=timeout)
        write_s = time.perf_counter() - start
        result = measure_streaming(
            target, prompt_len=prompt_len, new_tokens=new_tokens, seed=seed, timeout=timeout
        )
        result["write_s"] = write_s
        result["times_budget"] = result["disk_bytes"] / result["budget_bytes"]
        result["directory"] = str(target) if keep else None
    finally:
        if not keep:
            shutil.rmtree(created, ignore_errors=True)
    return result


if __name__ == "__main__":
    _task = json.loads(sys.argv[1])
    _kind = _task.pop("task")
    _fn = {"measure": _measure_here, "write": _write_here}[_kind]
    print(json.dumps(_fn(**_task)))
