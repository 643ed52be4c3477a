"""minidist.data: corpus split, tokenizer, packing, masking, distributed sampler; and MLM pre-training.

References: torch.utils.data.DistributedSampler for the sampler, the binomial distribution for
the masking proportions, the text itself for the tokenizer (decode(encode(x)) == normalised x).
The tokenizer's vocabulary ships with the library; the packed blocks come from the shared cache
(``$MINIDIST_CACHE``): on an empty cache the first test that needs them packs the corpus (about
5 s). One test trains a tokenizer on the whole training split (about 15 s on 2 cores) to check
that the shipped vocabulary is what the recipe makes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.utils.data

from minidist import data
from minidist.models import bert
from minidist.models.pretrain import PretrainConfig, evaluate_mlm, pretrain_mlm


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer()


@pytest.fixture(scope="module")
def eval_blocks(tok):
    return data.mlm_dataset(tok, seq_len=128, split="eval")


def test_split_is_by_article_and_covers_the_corpus():
    everything = data.corpus_articles("all")
    train, held_out = data.corpus_articles("train"), data.corpus_articles("eval")
    assert len(train) + len(held_out) == len(everything) > 10_000
    assert held_out == everything[data.HELD_OUT_EVERY - 1 :: data.HELD_OUT_EVERY]
    assert not set(held_out) & set(train)
    assert not any(a.startswith("#REDIRECT") or "'''" in a for a in everything)
    with pytest.raises(ValueError, match="unknown split"):
        data.corpus_articles("test")


def test_clean_wiki_text():
    text = "'''Anarchism''' is a ''philosophy''.\n==History==\n* first point\n\n# second"
    assert data.clean_wiki_text(text) == "Anarchism is a philosophy.\nfirst point\nsecond"


def test_tokenizer_specials_vocab_and_round_trip(tok):
    assert tok.get_vocab_size() == bert.CONFIGS["mini"].vocab_size == 8192
    assert data.special_token_ids(tok) == {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    encoding = tok.encode("The Hogwild trainer updates shared memory.")
    assert encoding.tokens[0] == "[CLS]" and encoding.tokens[-1] == "[SEP]"
    assert "[UNK]" not in encoding.tokens
    assert tok.decode(encoding.ids) == "the hogwild trainer updates shared memory."
    assert tok.encode("the", add_special_tokens=False).tokens == ["the"]  # frequent words stay whole


def test_shipped_vocabulary_is_what_training_on_the_course_text_makes(tok):
    # training is not bit-reproducible (ties between merges are broken in hash order), so the
    # shipped file and a fresh training agree on almost every token, not necessarily all
    trained = data.train_tokenizer(data.corpus_articles("train"), vocab_size=8192)
    shipped, fresh = data.vocabulary(tok), data.vocabulary(trained)
    assert len(shipped) == len(fresh) == 8192 and shipped[:5] == list(data.SPECIAL_TOKENS)
    assert len(set(shipped) & set(fresh)) >= 0.99 * 8192
    text = " ".join(data.corpus_articles("eval")[:20])
    assert tok.decode(tok.encode(text).ids) == trained.decode(trained.encode(text).ids)
    assert tok.encode(text).ids == data.tokenizer_from_vocab(shipped).encode(text).ids


def test_tokenizer_from_vocab_refuses_repeated_tokens():
    with pytest.raises(ValueError, match="repeated"):
        data.tokenizer_from_vocab(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "a"])


def test_train_tokenizer_on_a_small_text():
    small = data.train_tokenizer(["low lower lowest newer newest wider widest"] * 20, vocab_size=60)
    assert small.get_vocab_size() <= 60
    pieces = small.encode("lowest", add_special_tokens=False).tokens
    assert "".join(p.removeprefix("##") for p in pieces) == "lowest"
    with pytest.raises(ValueError, match="special tokens"):
        data.train_tokenizer(["a"], vocab_size=5)


def test_pack_blocks_layout():
    blocks = data.pack_blocks([[10, 11, 12], [20, 21, 22, 23, 24], [30, 31]], cls_id=2, sep_id=3, seq_len=5)
    # stream 10 11 12 3 20 21 22 23 24 3 30 31 3 -> pieces of 4, the tail (3 tokens... 1 token) dropped
    assert blocks.tolist() == [[2, 10, 11, 12, 3], [2, 20, 21, 22, 23], [2, 24, 3, 30, 31]]
    assert blocks.dtype == torch.long


def test_mlm_dataset_is_cached_and_equals_a_fresh_packing(tok, eval_blocks):
    assert data.mlm.dataset_path(tok, 128, "eval").exists()
    fresh = data.mlm_dataset(tok, seq_len=128, split="eval", cache=False)
    assert torch.equal(fresh, eval_blocks)
    assert eval_blocks.shape[1] == 128 and 200 < len(eval_blocks) < 400
    assert (eval_blocks[:, 0] == 2).all()
    # Every article ends in [SEP]: as many [SEP] as articles, less those in the dropped tail.
    articles = len(data.corpus_articles("eval"))
    assert articles - 2 <= int((eval_blocks == 3).sum()) <= articles
    assert int((eval_blocks == 0).sum()) == 0  # no padding


def test_mask_tokens_invariants_and_proportions(tok, eval_blocks):
    ids = eval_blocks
    specials = torch.tensor([0, 1, 2, 3, 4])
    generator = torch.Generator().manual_seed(0)
    input_ids, labels = data.mask_tokens(ids, tok, generator)
    chosen = labels != data.IGNORE_INDEX
    is_special = torch.isin(ids, specials)
    # Invariants, exactly.
    assert not (chosen & is_special).any()
    assert torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(input_ids[~chosen], ids[~chosen])
    assert not torch.isin(input_ids[chosen], torch.tensor([0, 1, 2, 3])).any()
    assert input_ids.max() < tok.get_vocab_size()
    # Proportions: binomial, within 4 standard deviations.
    candidates = int((~is_special).sum())
    n_chosen = int(chosen.sum())

    def within(count, n, p):
        return abs(count - n * p) < 4 * math.sqrt(n * p * (1 - p))

    assert within(n_chosen, candidates, 0.15)
    became_mask = int((input_ids[chosen] == 4).sum())
    unchanged = int((input_ids[chosen] == ids[chosen]).sum())
    became_other = n_chosen - became_mask - unchanged
    # A random replacement equals the original with probability 1/8187 (negligible next to the bound).
    assert within(became_mask, n_chosen, 0.8)
    assert within(unchanged, n_chosen, 0.1)
    assert within(became_other, n_chosen, 0.1)
    # Same seed, same masks; the input is not modified.
    again = data.mask_tokens(ids, tok, torch.Generator().manual_seed(0))
    assert torch.equal(again.input_ids, input_ids) and torch.equal(again.labels, labels)
    assert torch.equal(ids, eval_blocks)


def _torch_indices(n, world_size, rank, **kw):
    dataset = range(n)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank, **kw)
    return sampler


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_against_torch(drop_last, shuffle):
    for n, world_size in itertools.product([1, 2, 3, 7, 10, 16, 33, 100], [1, 2, 3, 4, 8]):
        if n < world_size and not drop_last:
            continue  # covered below
        for epoch in (0, 1):
            ours, theirs = [], []
            for rank in range(world_size):
                sampler = data.DistributedSampler(
                    n, rank, world_size, seed=3, shuffle=shuffle, drop_last=drop_last
                )
                sampler.set_epoch(epoch)
                reference = _torch_indices(n, world_size, rank, seed=3, shuffle=shuffle, drop_last=drop_last)
                reference.set_epoch(epoch)
                ours.append(list(sampler))
                theirs.append(list(reference))
                assert len(sampler) == len(reference) == len(ours[-1])
            assert len({len(part) for part in ours}) == 1  # every rank the same number of steps
            union = [i for part in ours for i in part]
            assert sorted(union) == sorted(i for part in theirs for i in part)
            if drop_last:
                assert len(set(union)) == len(union) == (n // world_size) * world_size
            else:
                assert set(union) == set(range(n))
                assert len(union) - n == (-n) % world_size  # the padding, no more
            assert ours == theirs  # the same recipe: the two samplers can be swapped


def test_sampler_orders_differ_between_epochs_and_small_datasets():
    sampler = data.DistributedSampler(100, 0, 2, seed=0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first and len(first) == 50
    # fewer samples than ranks: everyone still gets one (padded); with drop_last none
    parts = [list(data.DistributedSampler(2, r, 5, shuffle=False)) for r in range(5)]
    assert parts == [[0], [1], [0], [1], [0]]
    assert list(data.DistributedSampler(2, 1, 5, drop_last=True)) == []
    with pytest.raises(ValueError, match="outside"):
        data.DistributedSampler(10, 4, 4)


@pytest.fixture
def one_thread():
    # On a shared 2-core machine, two torch threads per process wait on each other: one is ~7x faster here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_pretraining_lowers_held_out_loss(tok, eval_blocks, one_thread):
    # tiny BERT, 30 steps of 16 x 32 tokens on the first blocks of the train split (cut to 32 tokens).
    train = data.mlm_dataset(tok, seq_len=128, split="train")[:2000, :32].contiguous()
    held_out = eval_blocks[:, :32].contiguous()
    cfg = PretrainConfig(model="tiny", steps=30, batch_size=16, seq_len=32, lr=3e-3, warmup_steps=3)
    result = pretrain_mlm(cfg, tok, train, held_out)
    assert result.before.loss > math.log(8192) - 0.5  # near uniform at the start
    assert result.after.loss < result.before.loss - 1.0
    assert result.after.accuracy > result.before.accuracy
    assert result.tokens == 30 * 16 * 32
    # The evaluation is a pure function of model, blocks and seed.
    again = evaluate_mlm(result.model, held_out, tok, seed=cfg.eval_seed)
    assert again == result.after


def test_cuda_ids_get_the_same_masks_from_a_cpu_generator(tok, eval_blocks):
    ids = eval_blocks[:8]
    on_cpu = data.mask_tokens(ids, tok, torch.Generator().manual_seed(5))
    on_cuda = data.mask_tokens(ids.cuda(), tok, torch.Generator().manual_seed(5))
    assert on_cuda.input_ids.is_cuda
    assert torch.equal(on_cuda.input_ids.cpu(), on_cpu.input_ids)
    assert torch.equal(on_cuda.labels.cpu(), on_cpu.labels)
