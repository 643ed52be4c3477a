"""minidist.models.shards: safetensors shards with an index.

References: the saved model's own state dict (a round trip must give every tensor back bit for
bit), the parameter-count formula (the tied head stored once), the bytes of each tensor
(total_size), and a count of the files actually opened.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from minidist.models import decoder, shards
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig
from tiny import tiny_config


def _cfg(position: str = "learned", n_layers: int = 3) -> TransformerConfig:
    return tiny_config(
        vocab_size=61,
        n_layers=n_layers,
        max_positions=16,
        position=position,
        causal=True,
        pre_ln=True,
        embedding_layernorm=position == "alibi",  # BLOOM's layout with ALiBi
        layer_norm_eps=1e-5,
    )


def _model(position: str = "learned", n_layers: int = 3, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(_cfg(position, n_layers))
    with torch.no_grad():  # LayerNorms start at exactly 1 and 0: make them distinct values too
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("position", ["learned", "alibi"])
@pytest.mark.parametrize("blocks_per_shard", [1, 2])
def test_round_trip_bit_for_bit(tmp_path, position, blocks_per_shard):
    model = _model(position)
    index_path = shards.save_sharded(model, tmp_path / "ckpt", blocks_per_shard=blocks_per_shard)
    assert index_path == tmp_path / "ckpt" / shards.INDEX_NAME

    loaded = shards.load_decoder(tmp_path / "ckpt")
    assert loaded.cfg == model.cfg
    expected, got = model.state_dict(), loaded.state_dict()
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype and torch.equal(got[name], expected[name]), name
    assert all(p.requires_grad for p in loaded.parameters())
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_layout_one_shard_per_group(tmp_path):
    model = _model(n_layers=3)
    shards.save_sharded(model, tmp_path, blocks_per_shard=2)
    index = shards.read_index(tmp_path)
    n = shards.shard_count(3, 2)  # embeddings, blocks 0-1, block 2, final norm
    assert n == 4
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == index.files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    expected_file = {"embeddings": 1, "blocks.0": 2, "blocks.1": 2, "blocks.2": 3, "final_norm": 4}
    for name, file in index.weight_map.items():
        part = re.match(r"transformer\.(embeddings|blocks\.\d+|final_norm)\.", name).group(1)
        assert file == files[expected_file[part] - 1], name


def test_tied_head_stored_once_and_total_size(tmp_path):
    model = _model()
    shards.save_sharded(model, tmp_path)
    index = shards.read_index(tmp_path)
    tensors = shards.load_tensors(tmp_path)
    # every parameter once: the element count is the formula's (which counts the tied table once)
    assert sum(t.numel() for t in tensors.values()) == decoder.parameter_count(model.cfg)
    assert sum(p.numel() for p in model.parameters()) == decoder.parameter_count(model.cfg)
    assert index.total_size == 4 * decoder.parameter_count(model.cfg)
    raw = json.loads((tmp_path / shards.INDEX_NAME).read_text())
    assert raw["metadata"]["format"] == "minidist-decoder-v1"


def test_bf16_shards(tmp_path):
    model = _model()
    shards.save_sharded(model, tmp_path, dtype=torch.bfloat16)
    index = shards.read_index(tmp_path)
    assert index.total_size == 2 * decoder.parameter_count(model.cfg)
    tensors = shards.load_tensors(tmp_path)
    for name, t in model.state_dict().items():
        assert tensors[name].dtype == torch.bfloat16
        assert torch.equal(tensors[name], t.to(torch.bfloat16)), name
    loaded = shards.load_decoder(tmp_path)
    assert loaded.word_embeddings.dtype == torch.bfloat16
    as_fp32 = shards.load_decoder(tmp_path, dtype=torch.float32)
    assert torch.equal(as_fp32.word_embeddings, model.word_embeddings.to(torch.bfloat16).float())


class _CountingOpen:
    """Wraps safe_open and records which files were opened."""

    def __init__(self, real):
        self.real, self.opened = real, []

    def __call__(self, path, *args, **kwargs):
        self.opened.append(path.rsplit("/", 1)[-1])
        return self.real(path, *args, **kwargs)


def test_only_needed_shards_are_opened(tmp_path, monkeypatch):
    model = _model(n_layers=4)
    shards.save_sharded(model, tmp_path)
    index = shards.read_index(tmp_path)
    counter = _CountingOpen(shards.read.safe_open)
    monkeypatch.setattr(shards.read, "safe_open", counter)

    block = shards.load_block(tmp_path, 2)
    holder = index.weight_map[shards.block_prefix(2) + "attention.query.weight"]
    assert counter.opened == [holder]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    assert torch.equal(block(x), model.transformer.blocks[2](x))
    for name, t in block.state_dict().items():
        assert torch.equal(t, model.transformer.blocks[2].state_dict()[name])

    counter.opened.clear()
    names = ["transformer.embeddings.word.weight", "transformer.final_norm.weight"]
    got = shards.load_tensors(tmp_path, names=names)
    assert sorted(counter.opened) == [index.files[0], index.files[-1]]
    assert list(got) == names

    counter.opened.clear()
    shards.load_decoder(tmp_path)
    assert sorted(counter.opened) == index.files  # each shard opened once for the whole model


def test_unknown_format_and_config_are_refused(tmp_path):
    shards.save_sharded(_model(), tmp_path)
    path = tmp_path / shards.INDEX_NAME
    raw = json.loads(path.read_text())
    raw["metadata"]["format"] = "someone-elses-v3"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"{shards.INDEX_NAME}.*unknown checkpoint format"):
        shards.load_decoder(tmp_path)
    raw["metadata"]["format"] = shards.FORMAT
    raw["metadata"]["config"]["rotary"] = True
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rotary"):
        shards.read_index(tmp_path)
    with pytest.raises(ValueError, match="no checkpoint index"):
        shards.read_index(tmp_path / "nowhere")


def test_missing_shard_file_is_named(tmp_path):
    shards.save_sharded(_model(), tmp_path)
    index = shards.read_index(tmp_path)
    victim = index.weight_map[shards.block_prefix(1) + "mlp.up.weight"]
    (tmp_path / victim).unlink()
    shards.load_block(tmp_path, 0)  # other shards still load
    with pytest.raises(ValueError, match=f"{victim}.*missing"):
        shards.load_block(tmp_path, 1)
    with pytest.raises(ValueError, match=victim):
        shards.load_decoder(tmp_path)


@pytest.mark.parametrize("n_layers_in_index", [2, 4])
def test_missing_or_extra_names_are_refused(tmp_path, n_layers_in_index):
    shards.save_sharded(_model(n_layers=3), tmp_path)
    path = tmp_path / shards.INDEX_NAME
    raw = json.loads(path.read_text())
    raw["metadata"]["config"]["n_layers"] = n_layers_in_index
    path.write_text(json.dumps(raw))
    kind = "extra \\['transformer.blocks.2" if n_layers_in_index == 2 else "missing \\['transformer.blocks.3"
    with pytest.raises(ValueError, match=f"{shards.INDEX_NAME}.*{kind}"):
        shards.load_decoder(tmp_path)


def test_bad_requests_are_refused(tmp_path):
    shards.save_sharded(_model(), tmp_path)
    with pytest.raises(ValueError, match="no tensors named \\['transformer.head.weight'\\]"):
        shards.load_tensors(tmp_path, names=["transformer.head.weight"])
    with pytest.raises(ValueError, match="block 3 does not exist.*3 blocks"):
        shards.load_block(tmp_path, 3)
    with pytest.raises(ValueError, match="not both"):
        shards.load_tensors(tmp_path, prefix="transformer.", names=["transformer.final_norm.weight"])
    with pytest.raises(ValueError, match="blocks_per_shard"):
        shards.save_sharded(_model(), tmp_path / "other", blocks_per_shard=0)


def test_existing_directory(tmp_path):
    first, second = _model(seed=0), _model(seed=1)
    shards.save_sharded(first, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="not empty.*overwrite=True"):
        shards.save_sharded(second, tmp_path / "ckpt")
    shards.save_sharded(second, tmp_path / "ckpt", overwrite=True)
    assert torch.equal(shards.load_decoder(tmp_path / "ckpt").word_embeddings, second.word_embeddings)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="holds no model.safetensors.index.json"):
        shards.save_sharded(first, tmp_path / "mine", overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "mine"]  # no temporary left


def test_a_failed_write_leaves_no_checkpoint(tmp_path, monkeypatch):
    real_save = shards.write.save_file
    written = []

    def dies_on_third_shard(tensors, path, metadata=None):
        if len(written) == 2:
            raise KeyboardInterrupt("killed mid-write")
        written.append(path)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(shards.write, "save_file", dies_on_third_shard)
    with pytest.raises(KeyboardInterrupt):
        shards.save_sharded(_model(), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []  # neither the target nor a half-written temporary
    with pytest.raises(ValueError, match="no checkpoint index"):
        shards.load_decoder(tmp_path / "ckpt")


@pytest.mark.parametrize(
    "bad_file",
    [
        "../other/model-00001-of-00005.safetensors",  # a real shard name, one directory up
        "/etc/passwd",
        "sub/model-00001-of-00005.safetensors",
        "model-1-of-5.safetensors",
        5,
    ],
)
def test_weight_map_cannot_point_outside_the_directory(tmp_path, bad_file):
    # a second checkpoint next door: a traversing index would load its tensors without complaint
    shards.save_sharded(_model(seed=1), tmp_path / "other")
    shards.save_sharded(_model(seed=0), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / shards.INDEX_NAME
    raw = json.loads(path.read_text())
    name = next(iter(raw["weight_map"]))
    raw["weight_map"][name] = bad_file
    path.write_text(json.dumps(raw))
    for read in (shards.read_index, shards.load_decoder, lambda d: shards.load_tensors(d, names=[name])):
        with pytest.raises(ValueError, match=f"{shards.INDEX_NAME}.*{re.escape(repr(name))}"):
            read(tmp_path / "ckpt")


@pytest.mark.parametrize("weight_map", [["model-00001-of-00005.safetensors"], "x", 5, None])
def test_weight_map_must_be_an_object(tmp_path, weight_map):
    shards.save_sharded(_model(), tmp_path)
    path = tmp_path / shards.INDEX_NAME
    raw = json.loads(path.read_text())
    raw["weight_map"] = weight_map
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"{shards.INDEX_NAME}.*weight_map must be an object"):
        shards.read_index(tmp_path)


def test_a_writer_that_finished_first_is_not_overwritten(tmp_path, monkeypatch):
    """Two writers both see an empty target; the one that renames second must fail, not replace."""
    first, second = _model(seed=0), _model(seed=1)
    real_save = shards.write.save_file
    state = {"raced": False}

    def other_writer_finishes_meanwhile(tensors, path, metadata=None):
        if not state["raced"]:
            state["raced"] = True
            monkeypatch.setattr(shards.write, "save_file", real_save)
            shards.save_sharded(second, tmp_path / "ckpt")  # passed its own check, finishes first
            monkeypatch.setattr(shards.write, "save_file", other_writer_finishes_meanwhile)
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(shards.write, "save_file", other_writer_finishes_meanwhile)
    with pytest.raises(ValueError, match="filled by another writer.*overwrite=True"):
        shards.save_sharded(first, tmp_path / "ckpt")
    assert torch.equal(shards.load_decoder(tmp_path / "ckpt").word_embeddings, second.word_embeddings)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the loser's temporary is gone


def test_shards_and_index_reach_the_disk_before_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = shards.write.os.fsync, shards.write.os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(shards.write.os, "fsync", fsync)
    monkeypatch.setattr(shards.write.os, "rename", rename)
    shards.save_sharded(_model(n_layers=2), tmp_path / "ckpt")
    assert events[-1] == ("rename", str(tmp_path / "ckpt"))
    synced = {Path(p).name for kind, p in events[:-1] if kind == "fsync"}
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert files == {shards.shard_name(k, 4) for k in range(1, 5)} | {shards.INDEX_NAME}
    assert files <= synced
