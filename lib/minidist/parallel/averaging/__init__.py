"""Who averages the gradients: four architectures, each a DDP communication hook.

Every data-parallel step ends with the same result -- each worker holds the average of
the n workers' gradients -- but *who* adds them up decides who sends how much::

    central server          sharded server (every node)   ring allreduce        BytePS
    W0  W1  W2              W0 <-> W1                      W0 -> W1             W0  W1  W2
      \\ | /                 \\    /                             ^     |            |\\  /|\\ /|
        S                      W2                          W2 <-----+            S0  S1  (CPU)
    server moves n*M        each serves 1/n, 2(n-1)/n*M    2(n-1)/n*M per rank  + worker shards

All four are *push/pull* of pieces of a bucket to the process that sums that piece:
``PushPullAveraging`` is given, per bucket, a partition of its elements into pieces
and the owner of each piece (a server rank or a worker rank). A worker pushes every
piece it does not own to its owner, sums the pieces it owns (its own "summation
service") and sends the averages back, then pulls every other piece's average:

* ``"central"``: one extra process owns the whole bucket. Worker traffic: M out,
  M in; the server receives n*M and sends n*M -- linear in n: the bottleneck.
* ``"sharded"``: no extra process; worker r owns 1/n of each bucket. That is a
  reduce-scatter (pushes) followed by an allgather (pulls), written as point-to-point
  messages so the parameter-server view is visible: each worker sends
  2(n-1)/n*M -- the same bytes as the ring, in n-1 messages per phase instead of n-1
  ring steps (more concurrent messages, no pipelining along a ring).
* ``"ring"``: the default DDP hook with ``algorithm="ring"`` (for comparison).
* ``"byteps"``: k extra CPU-only summation servers *and* the workers' own summation
  services share each bucket. BytePS (Jiang et al., OSDI 2020, section 3.2) balances
  the busiest link: a worker sends x*M to the servers plus 2(n-1)/n*(1-x)*M for the
  worker shards; a server sends n*x*M/k. Equal when ::

      x = 2k(n-1) / (n^2 + kn - 2k)        (capped at 1: k >= n puts everything on servers)

  and then every machine sends 2n(n-1)/(n^2 + kn - 2k) * M: 2(n-1)/n*M with k = 0
  (allreduce), M with k = n (a sharded parameter server on CPU machines). A worker
  sends less as servers are added (for n >= 3; with n = 2 the ring already sends M).

The package: ``partition`` (who sums which piece of a bucket: ``partition``, the BytePS
share, ``servers_for``), ``push_pull`` (the protocol: ``PushPullAveraging``, the hook of
a worker, and ``serve_summation``, the loop of a server; ``make_hook`` picks the hook of an
architecture) and ``traffic`` (what a step costs: ``expected_bytes`` and the link-time model
``push_pull_seconds``, which the tests and ``python -m minidist.bench averaging`` check
against measurements).
"""

from .partition import ARCHITECTURES, Piece, byteps_server_share, partition, servers_for
from .push_pull import (
    HEADER_BYTES,
    HEADER_NUMEL,
    STOP,
    PushPullAveraging,
    RingAveraging,
    ServeReport,
    make_hook,
    serve_summation,
)
from .traffic import expected_bytes, push_pull_seconds

__all__ = [
    "ARCHITECTURES",
    "HEADER_BYTES",
    "HEADER_NUMEL",
    "STOP",
    "Piece",
    "PushPullAveraging",
    "RingAveraging",
    "ServeReport",
    "byteps_server_share",
    "expected_bytes",
    "make_hook",
    "partition",
    "push_pull_seconds",
    "serve_summation",
    "servers_for",
]
