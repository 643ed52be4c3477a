"""Checkpoints as safetensors shards with an index: the layout big models ship in.

Why shard? BLOOM-176B in fp16 is 176e9 x 2 bytes = 352 GB. One file that size cannot be read
into the memory of one machine, cannot be read by several processes that each need a part,
and a download that breaks at 300 GB starts again from zero. So the weights are cut into
shards (files of a few GB), and a small JSON index says which shard holds which tensor:

    layout   the files and the index (``INDEX_NAME``, ``shard_name``, ``block_prefix``, ``Index``)
    write    ``save_sharded``: every shard and the index, atomically
    read     ``read_index``, ``load_tensors``, ``load_block``, ``load_decoder``: only the shards
             that hold what is asked for
"""

from minidist.models.shards.layout import FORMAT, INDEX_NAME, Index, block_prefix, shard_count, shard_name
from minidist.models.shards.read import load_block, load_decoder, load_tensors, read_index
from minidist.models.shards.write import save_sharded

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "Index",
    "block_prefix",
    "load_block",
    "load_decoder",
    "load_tensors",
    "read_index",
    "save_sharded",
    "shard_count",
    "shard_name",
]
