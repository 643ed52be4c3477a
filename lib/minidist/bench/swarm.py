"""``python -m minidist.bench.swarm``: generated tokens/s locally and through a swarm of 2 and 3 servers.

Writes a random decoder (``--config``, default ``mini``) as shards, then generates with it in
this process and through ``serve.swarm`` swarms of 2 and 3 servers (even spans), with and
without the KV cache, and prints the Markdown table of ``docs/benchmarks.md``: tokens/s, the
ratio to the local model, the bytes exchanged per token and whether the tokens equal the local
ones.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
from collections.abc import Callable

import torch

from minidist import quant
from minidist.models import decoder, generate, shards
from minidist.serve.swarm import FORMATS, Client, Swarm, even_spans

__all__ = ["format_throughput", "main", "measure_throughput"]


def measure_throughput(
    directory: str | os.PathLike,
    servers: tuple[int, ...] = (2, 3),
    prompt_len: int = 16,
    new_tokens: int = 32,
    batch: int = 1,
    repeats: int = 3,
    fmt: str = "fp32",
    threads: int = 1,
    timeout: float = 120.0,
    seed: int = 0,
) -> dict:
    """Generated tokens/s locally and through swarms of ``servers`` servers, with and without KV cache.

    Every setup runs in each of ``repeats`` rounds, one after the other (side by side, so a busy
    machine slows all alike); the best round counts. The local model and every server use
    ``threads`` torch threads. Returns ``{"rows": [...], "ratios": {...}}``: a row per (setup,
    use_cache) with tokens_per_s, bytes_per_token (client <-> servers), vs_local (tokens/s over
    the local model's with the same use_cache) and same_tokens (equal to the local output);
    ratios["cache_speedup"][setup] = tokens/s with cache over without.
    """
    model = shards.load_decoder(directory).eval()
    if fmt != "fp32":
        quant.quantize_linear_weights(model, fmt)
    cfg = model.cfg
    prompt = torch.randint(cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(seed))
    previous_threads = torch.get_num_threads()
    rows: dict[tuple[str, bool], dict] = {}
    with contextlib.ExitStack() as stack:
        setups: dict[str, tuple[Callable, Swarm | None]] = {
            "local": (lambda n, cache: generate.generate(model, prompt, n, use_cache=cache), None)
        }
        for n in servers:
            swarm = stack.enter_context(
                Swarm(directory, even_spans(cfg.n_layers, n), fmt, timeout, threads_per_server=threads)
            )
            client = Client(swarm)
            setups[f"{n} servers"] = (
                lambda n_new, cache, c=client: c.generate(prompt, n_new, use_cache=cache),
                swarm,
            )
        torch.set_num_threads(threads)
        try:
            reference = {}
            for name, (run, _) in setups.items():  # warm-up, and the tokens every setup must give
                for cache in (True, False):
                    reference[name, cache] = run(new_tokens, cache)
            for _ in range(repeats):
                for name, (run, swarm) in setups.items():
                    for cache in (True, False):
                        before = swarm.bytes_exchanged() if swarm else 0
                        start = time.perf_counter()
                        run(new_tokens, cache)
                        seconds = time.perf_counter() - start
                        moved = (swarm.bytes_exchanged() if swarm else 0) - before
                        row = rows.setdefault((name, cache), {"seconds": math.inf})
                        if seconds < row["seconds"]:
                            row.update(seconds=seconds, bytes=moved)
        finally:
            torch.set_num_threads(previous_threads)
    local_ids = reference["local", True]
    out_rows = []
    for (name, cache), row in rows.items():
        tokens_per_s = batch * new_tokens / row["seconds"]
        local_tps = batch * new_tokens / rows["local", cache]["seconds"]
        out_rows.append(
            {
                "setup": name,
                "servers": 0 if name == "local" else int(name.split()[0]),
                "use_cache": cache,
                "tokens_per_s": tokens_per_s,
                "bytes_per_token": row["bytes"] / (batch * new_tokens),
                "vs_local": tokens_per_s / local_tps,
                "same_tokens": bool(torch.equal(reference[name, cache], local_ids)),
            }
        )
    speedup = {name: rows[name, False]["seconds"] / rows[name, True]["seconds"] for name in setups}
    return {
        "rows": out_rows,
        "ratios": {"cache_speedup": speedup},
        "config": {
            "n_layers": cfg.n_layers,
            "hidden": cfg.hidden_size,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "batch": batch,
            "fmt": fmt,
            "threads": threads,
            "repeats": repeats,
        },
    }


def format_throughput(result: dict) -> str:
    """The rows of ``measure_throughput`` as a Markdown table."""
    lines = [
        "| setup | KV cache | tokens/s | vs local | bytes/token | same tokens |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['setup']} | {'yes' if r['use_cache'] else 'no'} | {r['tokens_per_s']:.1f} | "
            f"{r['vs_local']:.2f}x | {r['bytes_per_token']:,.0f} | {r['same_tokens']} |"
        )
    speedups = ", ".join(f"{k} {v:.1f}x" for k, v in result["ratios"]["cache_speedup"].items())
    return "\n".join(lines) + f"\n\nKV cache speed-up (tokens/s with over without): {speedups}"


def main(argv: list[str] | None = None) -> None:  # the table of docs/benchmarks.md, on a random decoder
    parser = argparse.ArgumentParser(description="tokens/s locally and through a swarm of 2 and 3 servers")
    parser.add_argument("--config", default="mini", choices=["tiny", "mini", "small"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fmt", default="fp32", choices=FORMATS)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = decoder.DecoderLM(decoder.CONFIGS[args.config])
    with tempfile.TemporaryDirectory(prefix="minidist-swarm-") as directory:
        shards.save_sharded(model, directory)
        result = measure_throughput(
            directory,
            prompt_len=args.prompt_len,
            new_tokens=args.new_tokens,
            repeats=args.repeats,
            fmt=args.fmt,
        )
    print(f"decoder {args.config!r}: {result['config']}")
    print(format_throughput(result))


if __name__ == "__main__":
    main()
