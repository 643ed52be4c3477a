"""Serving a model too big for one machine's memory (lecture 9).

``offload``: a decoder run with only one or two blocks resident, the rest streamed from the
safetensors shards just in time (the next block prefetched on a thread).
``swarm``: a Petals-style swarm -- server processes each hold a span of blocks, a client holds
the embeddings and head, routes hidden states through servers that cover every block, keeps a
KV cache per session on each server, and fails over to another server when one dies.
Each is a package with one idea per module (its docstring lists them); ``_server`` and ``_wire``
are the swarm's server process and message format. ``finetune``: training adapters through a swarm.

Import the submodules (``from minidist.serve import offload, swarm``); this package imports
nothing so that ``import minidist`` stays light.
"""
