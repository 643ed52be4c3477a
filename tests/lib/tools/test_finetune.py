"""Fine-tuning through the swarm (``minidist.serve.finetune``).

References: the same training done in one process (``models.lora.finetune`` on the decoder
loaded from the same shards, the same starting adapters or prompt, fp32), the checkpoint's
tensors (the servers' blocks must not change), and the loss before training.
"""

from __future__ import annotations

import math

import pytest
import torch

from minidist.models import lora, shards
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig
from minidist.serve import finetune, swarm

# init_std 0.2: a random base with 0.02 has word vectors too short for adapters to move the (tied,
# frozen) output logits far from uniform; the larger init stands in for a pretrained model.
CFG = TransformerConfig(
    vocab_size=64,
    hidden_size=32,
    n_layers=2,
    n_heads=4,
    max_positions=32,
    causal=True,
    pre_ln=True,
    embedding_layernorm=False,
    layer_norm_eps=1e-5,
    init_std=0.2,
)


def copy_task(n_batches: int = 4, batch: int = 8, half: int = 6, seed: int = 3) -> list:
    """Sequences "a b c ... | a b c ..." over a 16-token sub-vocabulary; only the second half is scored."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        first = torch.randint(0, 16, (batch, half), generator=g)
        input_ids = torch.cat([first, first], dim=1)
        labels = input_ids.clone()
        labels[:, :half] = -100
        out.append((input_ids, labels))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("finetune") / "decoder"
    shards.save_sharded(DecoderLM(CFG), directory)
    return directory


@pytest.fixture
def client(checkpoint):
    """Two servers of one block each, started per test (the suite checks that no process outlives a test)."""
    with swarm.Swarm(checkpoint, spans=[(0, 1), (1, 2)], fmt="fp32", timeout=60) as sw:
        yield swarm.Client(sw)


def local_model(checkpoint) -> DecoderLM:
    return shards.load_decoder(checkpoint).eval()


def test_lora_through_the_swarm_equals_local_training(checkpoint, client):
    model = local_model(checkpoint)
    torch.manual_seed(1)
    lora.apply_lora(model, targets=("query", "value"), rank=4, alpha=8.0)
    start = lora.adapters_of(model, clone=True)
    batches = copy_task()
    run = finetune.finetune_through_swarm(client, batches, steps=6, method="lora", lr=1e-2, adapters=start)
    local_losses = lora.finetune(model, batches, steps=6, lr=1e-2)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(local_losses), rtol=1e-5, atol=1e-5)
    trained = lora.adapters_of(model)
    assert run.adapters["scale"] == trained["scale"] == 2.0
    for block in range(CFG.n_layers):
        for target in ("query", "value"):
            for remote, here in zip(run.adapters[block][target], trained[block][target]):
                torch.testing.assert_close(remote, here.detach(), rtol=1e-4, atol=1e-5)
    assert run.adapters[0]["query"][1].abs().sum() > 0  # B moved away from zero
    assert run.bytes_exchanged > 0


def test_prompt_tuning_through_the_swarm_equals_local_training(checkpoint, client):
    model = local_model(checkpoint)
    model.requires_grad_(False)
    torch.manual_seed(2)
    prompt = lora.PromptTuning(4, CFG.hidden_size)
    start = prompt.prompts.detach().clone().requires_grad_(True)
    batches = copy_task()
    run = finetune.finetune_through_swarm(client, batches, steps=6, method="prompt", lr=3e-2, prompts=start)
    local_losses = lora.finetune(model, batches, steps=6, lr=3e-2, prompt=prompt)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(local_losses), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run.prompts.detach(), prompt.prompts.detach(), rtol=1e-4, atol=1e-5)


def test_lora_through_the_swarm_lowers_the_loss_and_leaves_the_servers_unchanged(checkpoint, client):
    batches = copy_task()
    before = finetune.evaluate_through_swarm(client, batches)
    attention = ("query", "key", "value", "output")
    run = finetune.finetune_through_swarm(
        client, batches, steps=30, method="lora", lr=1e-2, rank=4, targets=attention, seed=0
    )
    after = finetune.evaluate_through_swarm(client, batches, adapters=run.adapters)
    # ln 16 = 2.77: the best loss without looking back at the first half (16 equally likely tokens).
    assert after < min(0.8 * before, math.log(16))
    # The trained adapters, loaded into a local model, give the loss the swarm measured.
    model = local_model(checkpoint)
    lora.apply_lora(model, targets=attention, rank=4)
    lora.load_adapters(model, run.adapters)
    with torch.no_grad():
        local = sum(model(x, labels=y).loss.item() for x, y in batches) / len(batches)
    assert local == pytest.approx(after, rel=1e-5)
    # Servers never train: every block tensor equals the checkpoint's, bit for bit.
    stored = shards.load_tensors(checkpoint, prefix="transformer.blocks.")
    served = {}
    for i in range(len(client.swarm)):
        served.update(client.swarm.request(i, "weights"))
    assert served.keys() == stored.keys()
    assert all(torch.equal(served[n], stored[n]) for n in stored)


def test_init_adapters_match_the_formula_and_start_at_zero_update():
    adapters = finetune.init_adapters(CFG, rank=4, alpha=8.0, targets=("query", "key", "value"))
    tensors = finetune.adapter_tensors(adapters)
    assert sum(t.numel() for t in tensors) == lora.lora_parameter_count(CFG, 4, ("query", "key", "value"))
    assert adapters["scale"] == 2.0
    assert all(
        torch.equal(B, torch.zeros_like(B))
        for targets in (adapters[0], adapters[1])
        for _, B in targets.values()
    )
    assert finetune.init_prompts(CFG, 5).shape == (5, CFG.hidden_size)


def test_finetune_through_swarm_refuses_bad_arguments():
    batches = copy_task(1)

    class NoSwarm:  # every check happens before the first request
        cfg = CFG

    client = NoSwarm()
    with pytest.raises(ValueError, match="method"):
        finetune.finetune_through_swarm(client, batches, 1, method="full")
    with pytest.raises(ValueError, match='method="prompt"'):
        finetune.finetune_through_swarm(client, batches, 1, method="lora", prompts=finetune.init_prompts(CFG))
    with pytest.raises(ValueError, match="leaves"):
        frozen = finetune.init_adapters(CFG, rank=2)
        frozen[0]["query"][0].requires_grad_(False)
        finetune.finetune_through_swarm(client, batches, 1, adapters=frozen)
    with pytest.raises(ValueError, match="unknown targets"):
        finetune.init_adapters(CFG, targets=("q_proj",))
    # the MLP's layers are LoRA targets locally, but swarm servers adapt only attention projections
    with pytest.raises(
        ValueError, match=r"targets \['up'\]: swarm servers .*'query', 'key', 'value', 'output'"
    ):
        finetune.init_adapters(CFG, targets=("query", "up"))
