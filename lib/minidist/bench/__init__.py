"""Benchmarks: ``python -m minidist.bench NAME`` (``__main__`` lists the names).

One module or package per benchmark -- ``p2p``, ``launch``, ``collectives``, ``glove``, ``ddp``,
``large_batch``, ``compression``, ``averaging``, ``model_parallel``, ``swarm`` -- each opening
with what it measures; results and how to read them: docs/benchmarks.md. A benchmark measures
and prints; what it measures lives in the library.
"""
