"""The Petals-style swarm (``minidist.serve.swarm``) against the same model run in this process.

References: ``generate.generate`` on the local model (tokens), the model's own blocks with LoRA
hooks written out here from the formula s·(x Aᵀ)Bᵀ (hidden states and gradients), the shards
(server weights unchanged after training), psutil (no process left behind).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from conftest import wait_until
from minidist import quant
from minidist.bench import swarm as swarm_bench
from minidist.models import generate, lora, shards
from minidist.models.decoder import DecoderLM
from minidist.models.transformer import TransformerConfig, attention_bias
from minidist.serve import _wire, swarm

N_LAYERS = 4


def make_model(position: str = "learned", seed: int = 0) -> DecoderLM:
    cfg = TransformerConfig(
        vocab_size=64,
        hidden_size=32,
        n_layers=N_LAYERS,
        n_heads=4,
        max_positions=32,
        position=position,
        causal=True,
        pre_ln=True,
        embedding_layernorm=position == "alibi",
        layer_norm_eps=1e-5,
        init_std=0.3,  # at 0.02 a random decoder repeats one token; larger weights give varied text
    )
    torch.manual_seed(seed)
    model = DecoderLM(cfg)
    with torch.no_grad():  # non-zero biases and norms, so a step that dropped one would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, model): a 4-block decoder saved as shards, one block per shard."""
    model = make_model()
    directory = tmp_path_factory.mktemp("swarm-ckpt")
    shards.save_sharded(model, directory)
    return directory, model


@pytest.fixture(scope="module")
def alibi_checkpoint(tmp_path_factory):
    model = make_model("alibi", seed=1)
    directory = tmp_path_factory.mktemp("swarm-alibi")
    shards.save_sharded(model, directory)
    return directory, model


def prompt_ids(batch: int = 2, length: int = 5, seed: int = 3) -> torch.Tensor:
    return torch.randint(64, (batch, length), generator=torch.Generator().manual_seed(seed))


def gone(pids: list[int]) -> bool:
    def dead(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(dead(pid) for pid in pids)


# --- no processes -----------------------------------------------------------------------------
def test_wire_round_trip_keeps_dtypes_shapes_and_values():
    message = {
        "hidden": torch.randn(2, 3, 4),
        "codes": torch.randint(-127, 128, (5,), dtype=torch.int8),
        "half": torch.randn(3, 2).to(torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "empty": torch.empty(0, 7),
        "strided": torch.arange(12.0).reshape(3, 4).T,  # not contiguous
        "nested": [1, 2.5, "x", None, (3, {0: torch.ones(2)})],
    }
    back = _wire.decode(_wire.encode(message))
    for key in ("hidden", "codes", "half", "mask", "empty", "strided"):
        assert back[key].dtype == message[key].dtype and torch.equal(back[key], message[key])
    assert back["nested"][:4] == [1, 2.5, "x", None] and torch.equal(back["nested"][4][1][0], torch.ones(2))


def test_wire_refuses_globals_and_oversized_messages():
    with pytest.raises(pickle.UnpicklingError, match="only dicts, lists"):
        _wire.decode(pickle.dumps(os.getcwd))  # a function: would be code, refused
    a, b = __import__("socket").socketpair()
    with a, b:
        with pytest.raises(ValueError, match="over the limit of 1,000 bytes"):
            _wire.send_message(a, torch.zeros(1000), max_bytes=1000)
        _wire.send_message(a, torch.zeros(1000))
        with pytest.raises(_wire.OversizedMessage, match="announced a message of") as info:
            _wire.recv_message(b, max_bytes=1000)
        assert info.value.limit == 1000 and info.value.size > 1000


def payload_with_record(record: object) -> bytes:
    """A message payload whose one tensor is the raw persistent record ``record`` (as a peer could send)."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return record if isinstance(obj, str) and obj == "TENSOR" else None

    buffer = io.BytesIO()
    Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump({"op": "step", "hidden": "TENSOR"})
    return buffer.getvalue()


BAD_RECORDS = [  # (record, what the error must say)
    (("tensor", "float32", (2, 3), bytes(5)), "needs 24 bytes, carries 5"),  # length != numel * 4
    (("tensor", "float32", (1 << 40,), b""), "needs 4,398,046,511,104 bytes, carries 0"),  # huge, no data
    (("tensor", "float32", (3,), b""), "needs 12 bytes, carries 0"),  # was torch.empty: leaked memory
    (("tensor", "float32", (-1,), b""), "non-negative"),
    (("tensor", "float32", [2], bytes(8)), "not a tuple"),
    (("tensor", "Tensor", (1,), bytes(4)), "dtype 'Tensor'"),  # an attribute of torch, not a dtype
    (("tensor", "float32", (2,)), "must be"),
]


def test_wire_refuses_malformed_tensor_records_with_a_value_error():
    for record, message in BAD_RECORDS:
        with pytest.raises(_wire.MalformedMessage, match=message):
            _wire.decode(payload_with_record(record))
    with pytest.raises(ValueError, match="not a message"):
        _wire.decode(b"\x80\x05garbage")
    assert issubclass(_wire.MalformedMessage, ValueError) and issubclass(_wire.OversizedMessage, ValueError)
    good = payload_with_record(("tensor", "int16", (2, 0, 3), b""))
    assert _wire.decode(good)["hidden"].shape == (2, 0, 3)


def test_route_takes_fewest_hops_and_names_missing_blocks():
    spans = {0: (0, 2), 1: (2, 4), 2: (1, 4)}
    assert swarm.plan_route(spans, 0, 4) == [swarm.Hop(0, 0, 2), swarm.Hop(1, 2, 4)]  # tie: lowest index
    assert swarm.plan_route({**spans, 3: (0, 4)}, 0, 4) == [swarm.Hop(3, 0, 4)]
    assert swarm.plan_route({0: (0, 2), 2: (1, 4)}, 2, 4) == [swarm.Hop(2, 2, 4)]  # part of a span
    with pytest.raises(swarm.RouteError, match=r"block\(s\) 2\.\.3 ") as info:
        swarm.plan_route({0: (0, 2)}, 0, 4)
    assert info.value.missing == [2, 3]
    assert swarm.even_spans(4, 3) == [(0, 1), (1, 3), (3, 4)]
    with pytest.raises(ValueError, match="n_servers <= n_layers"):
        swarm.even_spans(2, 3)


def test_bad_arguments_are_refused(checkpoint):
    directory, _ = checkpoint
    with pytest.raises(ValueError, match=r"span 1 is \(2, 5\).*4 blocks"):
        swarm.Swarm(directory, [(0, 2), (2, 5)])
    with pytest.raises(ValueError, match="unknown format"):
        swarm.Swarm(directory, [(0, 4)], fmt="int3")


def test_a_server_that_cannot_load_its_blocks_is_reported(checkpoint, tmp_path):
    directory, _ = checkpoint
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    block_3 = shards.read_index(broken).weight_map[shards.block_prefix(3) + "mlp.up.weight"]
    (broken / block_3).unlink()
    with pytest.raises(
        swarm.ServerFailed, match=r"server 1 failed: could not load blocks \(2, 4\)(.|\n)*missing"
    ):
        swarm.Swarm(broken, [(0, 2), (2, 4)], timeout=30).start()


# --- generation -------------------------------------------------------------------------------
def test_generation_through_two_servers_equals_local(checkpoint):
    directory, model = checkpoint
    ids = prompt_ids()
    expected = generate.generate(model, ids, 12)
    with swarm.Swarm(directory, [(0, 2), (2, 4)], timeout=30) as sw:
        client = swarm.Client(sw)
        assert client.route() == [swarm.Hop(0, 0, 2), swarm.Hop(1, 2, 4)]
        assert torch.equal(client.generate(ids, 12, use_cache=True), expected)
        assert torch.equal(client.generate(ids, 12, use_cache=False), expected)
        assert len(set(expected[0, 5:].tolist())) > 2  # varied text, not one repeated token
        assert [info["sessions"] for info in (sw.request(i, "info") for i in range(2))] == [0, 0]  # closed
        # a cache per (session, block) on the server: 5 positions of keys and values in 2 blocks
        with client.inference_session() as session:
            session.step(client.embed(ids))
            info = sw.request(0, "info")
            assert info["cache_bytes"] == 2 * 2 * ids.shape[0] * 5 * 32 * 4 and info["sessions"] == 1
            # a step whose past_len disagrees with the cache is refused by the server
            with pytest.raises(swarm.RemoteError, match="holds 5 positions but past_len is 3"):
                sw.request(
                    0, "step", session=session.hops[0].session, hidden=torch.zeros(2, 1, 32), past_len=3
                )
        assert not client.failovers


def test_failover_replays_the_session_and_continues_identically(alibi_checkpoint):
    directory, model = alibi_checkpoint  # ALiBi: a replayed position with a wrong offset would show
    ids = prompt_ids(seed=4)
    expected = generate.generate(model, ids, 12)
    kills = {
        4: 1,
        8: 2,
    }  # after token 4 server 1 dies, after token 8 its replacement (whose history was a replay)
    with swarm.Swarm(directory, [(0, 2), (2, 4), (1, 4), (2, 4)], timeout=30) as sw:
        client = swarm.Client(sw)
        out = client.generate(ids, 12, on_token=lambda t, _: sw.kill(kills[t]) if t in kills else None)
        assert torch.equal(out, expected)
        assert [(f["server"], f["blocks"], f["during"]) for f in client.failovers] == [
            (1, (2, 4), "generate"),
            (2, (2, 4), "generate"),
        ]
        assert "SIGKILL" in client.failovers[0]["reason"]
        assert client.route() == [swarm.Hop(0, 0, 2), swarm.Hop(3, 2, 4)]
        assert not sw.alive(1) and not sw.alive(2) and sw.alive(3)


def test_failover_of_the_first_hop_and_during_the_replay_is_bit_identical(checkpoint, monkeypatch):
    """A replayed cache equals the lost one bit for bit: every output after a failover is torch.equal
    to the undisturbed session's. The first hop fails (blocks 0..1); later the second hop fails and
    its first replacement dies during the replay itself, so the replay starts again on another."""
    directory, _ = checkpoint
    gen = torch.Generator().manual_seed(12)
    steps = [torch.randn(2, 5, 32, generator=gen)] + [torch.randn(2, 1, 32, generator=gen) for _ in range(6)]
    with swarm.Swarm(directory, [(0, 2), (2, 4), (0, 2), (2, 4), (2, 4)], timeout=30) as sw:
        client = swarm.Client(sw)
        with client.inference_session() as session:  # undisturbed, on servers 0 and 1
            expected = [session.step(h) for h in steps]
        assert not client.failovers

        real_request, steps_on_3 = sw.request, []

        def request(i, op, **fields):  # server 3 dies at its third step request: during a replay
            if i == 3 and op == "step":
                steps_on_3.append(fields["past_len"])
                if len(steps_on_3) == 3:
                    sw.kill(3)
            return real_request(i, op, **fields)

        monkeypatch.setattr(sw, "request", request)
        kills = {3: 0, 5: 1}  # before step 3 the first hop's server, before step 5 the second's
        with client.inference_session() as session:
            for t, h in enumerate(steps):
                if t in kills:
                    sw.kill(kills[t])
                out = session.step(h)
                assert torch.equal(out, expected[t]), t
            assert [(hop.server, hop.start, hop.end) for hop in session.hops] == [(2, 0, 2), (4, 2, 4)]
        assert [(f["server"], f["blocks"], f["during"]) for f in client.failovers] == [
            (0, (0, 2), "generate"),
            (1, (2, 4), "generate"),
            (3, (2, 4), "replay"),
        ]
        assert steps_on_3 == [0, 5, 6]  # the replay sends the prompt, then one position per request


def test_killed_server_without_alternative_raises_naming_the_blocks(checkpoint):
    directory, _ = checkpoint
    with swarm.Swarm(directory, [(0, 2), (2, 4)], timeout=30) as sw:
        client = swarm.Client(sw)
        with pytest.raises(swarm.RouteError, match=r"block\(s\) 2\.\.3 .*server 0: blocks 0\.\.1"):
            client.generate(prompt_ids(), 8, on_token=lambda t, _: sw.kill(1) if t == 3 else None)
        assert client.failovers[0]["server"] == 1
        with pytest.raises(swarm.ServerFailed, match="server 1 failed: was killed by SIGKILL"):
            sw.request(1, "info")


def test_stuck_server_times_out_and_is_killed(checkpoint):
    directory, _ = checkpoint
    with swarm.Swarm(directory, [(0, 4)], timeout=30) as sw:  # loading gets the generous default
        pid = sw.pids()[0]
        with pytest.raises(swarm.ServerFailed, match=r"no answer to 'sleep' within 1.0 s"):
            sw.request(0, "sleep", timeout=1.0, seconds=120)
        assert gone([pid]) and not sw.alive(0)
        with pytest.raises(swarm.RouteError, match=r"block\(s\) 0\.\.3"):
            swarm.Client(sw).generate(prompt_ids(), 2)


def test_a_server_survives_oversized_and_malformed_messages_and_limits_sessions(checkpoint):
    directory, _ = checkpoint
    limit = 20_000
    with swarm.Swarm(directory, [(0, 4)], timeout=30, max_message_bytes=limit, max_sessions=2) as sw:
        pid = sw.pids()[0]

        def raw(payload: bytes) -> dict:  # a peer that ignores the limit or sends broken bytes
            sock = sw._socks[0]
            sock.settimeout(30)
            sock.sendall(len(payload).to_bytes(8, "big") + payload)
            reply, _ = _wire.recv_message(sock, deadline=time.monotonic() + 30)
            return reply

        # the server knows the swarm's limit: a reply over it becomes an error, the server stays
        with pytest.raises(swarm.RemoteError, match="over the limit of 20,000 bytes"):
            sw.request(0, "weights")
        # a request over it is refused by the client before sending
        with pytest.raises(ValueError, match="over the limit of 20,000 bytes"):
            sw.request(0, "forward", hidden=torch.zeros(1, 200, 32))
        # ... and by the server, which reads and drops it, answers, and keeps serving
        big = _wire.encode({"op": "info", "pad": torch.zeros(10_000)})
        assert "over this server's limit of 20,000 bytes" in raw(big)["error"]
        # malformed payloads: answered with an error, never a dead server
        for record, message in BAD_RECORDS:
            assert message in raw(payload_with_record(record))["error"], record
        assert "not a message" in raw(b"\x80\x05garbage")["error"]
        assert sw.request(0, "info")["span"] == (0, 4) and sw.alive(0) and sw.pids()[0] == pid

        # at most max_sessions open sessions (KV caches) per server
        sw.request(0, "open", session="a")
        sw.request(0, "open", session="b")
        with pytest.raises(
            swarm.RemoteError, match=r"holds 2 open sessions, its limit \(max_sessions\) is 2"
        ):
            sw.request(0, "open", session="c")
        sw.request(0, "close", session="a")
        sw.request(0, "open", session="c")
        assert sw.request(0, "info")["sessions"] == 2 and sw.alive(0)
    with pytest.raises(ValueError, match="max_message_bytes must be between 4096"):
        swarm.Swarm(directory, [(0, 4)], max_message_bytes=100)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_servers_equal_the_local_quantized_model(checkpoint, fmt):
    directory, _ = checkpoint
    local = quant.quantize_linear_weights(shards.load_decoder(directory), fmt).eval()
    ids = prompt_ids(seed=5)
    with swarm.Swarm(directory, [(0, 2), (2, 4)], fmt=fmt, timeout=30) as sw:
        client = swarm.Client(sw)
        assert torch.equal(client.generate(ids, 10), generate.generate(local, ids, 10))
        assert all(info["fmt"] == fmt for info in sw.info)
        # the bytes each server holds: those of the same blocks quantized here (fp32 would be 4x int8's)
        for info, blocks in zip(sw.info, (local.transformer.blocks[:2], local.transformer.blocks[2:])):
            held = sum(t.numel() * t.element_size() for b in blocks for t in (*b.parameters(), *b.buffers()))
            assert info["weight_bytes"] == held
        hidden = client.embed(ids)
        with torch.no_grad():
            expected = local_blocks(local, hidden, None)
        torch.testing.assert_close(client.forward(hidden), expected, rtol=0, atol=1e-5)


# --- training ---------------------------------------------------------------------------------
def local_blocks(model: DecoderLM, hidden: torch.Tensor, adapters: dict | None) -> torch.Tensor:
    """The model's own blocks over ``hidden``, LoRA added by hooks: out + s·(x Aᵀ)Bᵀ."""
    handles = []
    for i, targets in (adapters or {}).items():
        if i == "scale":
            continue
        for target, (A, B) in targets.items():
            layer = getattr(model.transformer.blocks[i].attention, target)

            def hook(module, inputs, out, A=A, B=B, s=adapters["scale"]):
                return out + s * (inputs[0] @ A.T) @ B.T

            handles.append(layer.register_forward_hook(hook))
    try:
        bias = attention_bias(model.cfg, hidden.shape[1], None, hidden.dtype, hidden.device)
        x = hidden
        for block in model.transformer.blocks:
            x = block(x, bias)
        return x
    finally:
        for handle in handles:
            handle.remove()


def make_adapters(rank: int = 2, seed: int = 7) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def pair(requires_grad=True):
        A = (0.3 * torch.randn(rank, 32, generator=gen)).requires_grad_(requires_grad)
        B = (0.3 * torch.randn(32, rank, generator=gen)).requires_grad_(requires_grad)  # B != 0: A gets grads
        return A, B

    return {0: {"query": pair(), "value": pair()}, 1: {"value": pair()}, 3: {"query": pair()}, "scale": 2.0}


def leaves(adapters: dict) -> list[torch.Tensor]:
    return [t for k, targets in adapters.items() if k != "scale" for pair in targets.values() for t in pair]


def gradients(run, hidden, prompts, adapters) -> list[torch.Tensor]:
    """d(sum of out · fixed weights)/d(hidden, prompts, every A and B)."""
    hidden = hidden.detach().clone().requires_grad_(True)
    prompts = prompts.detach().clone().requires_grad_(True)
    adapters = {
        k: v
        if k == "scale"
        else {t: tuple(x.detach().clone().requires_grad_(True) for x in p) for t, p in v.items()}
        for k, v in adapters.items()
    }
    out = run(hidden, prompts, adapters)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    inputs = [hidden, prompts, *leaves(adapters)]
    return [out.detach(), *torch.autograd.grad((out * weights).sum(), inputs)]


def test_gradients_through_the_swarm_equal_local_and_blocks_stay_frozen(checkpoint):
    directory, model = checkpoint
    model.requires_grad_(False)
    hidden = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(8))
    prompts = 0.5 * torch.randn(3, 32, generator=torch.Generator().manual_seed(9))
    adapters = make_adapters()

    def local(h, p, a):
        return local_blocks(model, torch.cat([p.expand(h.shape[0], -1, -1), h], dim=1), a)

    expected = gradients(local, hidden, prompts, adapters)
    with swarm.Swarm(directory, [(0, 2), (2, 4), (0, 4)], timeout=30) as sw:
        client = swarm.Client(sw)
        assert client.route() == [swarm.Hop(2, 0, 4)]
        got = gradients(lambda h, p, a: client.forward(h, adapters=a, prompts=p), hidden, prompts, adapters)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-5)

        # server 2 dies between forward and backward: backward recomputes over servers 0 and 1
        h = hidden.clone().requires_grad_(True)
        params = leaves(adapters)
        out = client.forward(h, adapters=adapters)
        sw.kill(2)
        got_adapters = torch.autograd.grad(out, [h, *params], torch.ones_like(out))
        reference_h = hidden.clone().requires_grad_(True)
        reference = torch.autograd.grad(
            local_blocks(model, reference_h, adapters), [reference_h, *params], torch.ones_like(out)
        )
        for g, e in zip(got_adapters, reference, strict=True):  # the hidden states' and every A's and B's
            torch.testing.assert_close(g, e, rtol=0, atol=1e-5)
        assert [(f["server"], f["during"]) for f in client.failovers] == [(2, "backward")]

        # a few SGD steps on the adapters: the loss goes down, the servers' blocks do not change
        ids = prompt_ids(batch=2, length=8, seed=10)
        params = leaves(adapters)
        optimizer = torch.optim.SGD(params, lr=0.05)
        before = [p.detach().clone() for p in params]
        losses = []
        for _ in range(4):
            loss = client.lm_forward(ids, labels=ids, adapters=adapters).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
        assert all(not torch.equal(p, b) for p, b in zip(params, before))
        stored = shards.load_tensors(directory)
        for i in (0, 1):
            for name, t in sw.request(i, "weights").items():
                assert torch.equal(t, stored[name]), name


def test_lm_forward_equals_the_model_and_local_prompt_tuning(checkpoint):
    directory, model = checkpoint
    ids = prompt_ids(batch=2, length=8, seed=11)
    prompt = lora.PromptTuning(3, 32, init_std=0.5)
    local = lora.prompt_forward(model, prompt, ids, labels=ids)
    (expected_grad,) = torch.autograd.grad(local.loss, [prompt.prompts])
    with swarm.Swarm(directory, [(0, 3), (3, 4)], timeout=30) as sw:
        client = swarm.Client(sw)
        plain = client.lm_forward(ids, labels=ids)
        tuned = client.lm_forward(ids, labels=ids, prompts=prompt.prompts)
        (grad,) = torch.autograd.grad(tuned.loss, [prompt.prompts])
    expected = model(ids, labels=ids)
    torch.testing.assert_close(plain.logits, expected.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(plain.loss, expected.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(tuned.logits, local.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(tuned.loss, local.loss, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-5)


def test_measure_throughput_rows(checkpoint):
    directory, _ = checkpoint
    result = swarm_bench.measure_throughput(
        directory, servers=(2, 3), prompt_len=4, new_tokens=3, repeats=1, timeout=60
    )
    rows = {(r["setup"], r["use_cache"]): r for r in result["rows"]}
    assert set(rows) == {(s, c) for s in ("local", "2 servers", "3 servers") for c in (True, False)}
    assert all(r["same_tokens"] and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["local", True]["vs_local"] == 1.0 and rows["local", True]["bytes_per_token"] == 0
    for setup in ("2 servers", "3 servers"):  # bytes are counted, not timed: the cache sends less
        assert 0 < rows[setup, True]["bytes_per_token"] < rows[setup, False]["bytes_per_token"]
    assert rows["2 servers", True]["bytes_per_token"] < rows["3 servers", True]["bytes_per_token"]
    assert "| 3 servers | no |" in swarm_bench.format_throughput(result)


# --- processes --------------------------------------------------------------------------------
def test_every_server_is_stopped_when_the_client_code_raises(checkpoint):
    directory, _ = checkpoint
    with (
        pytest.raises(RuntimeError, match="client bug"),
        swarm.Swarm(directory, [(0, 2), (2, 4), (0, 4)]) as sw,
    ):
        pids = sw.pids()
        assert len(pids) == 3 and not gone(pids)
        raise RuntimeError("client bug")
    assert gone(pids)
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid in pids]


def test_servers_exit_when_the_client_process_dies(checkpoint, tmp_path):
    directory, _ = checkpoint
    pid_file = tmp_path / "pids"
    script = os.path.join(os.path.dirname(__file__), "swarm_workers.py")
    client = subprocess.Popen(
        [sys.executable, script, str(directory), str(pid_file)], stdout=subprocess.DEVNULL
    )
    try:
        assert client.wait(timeout=90) == -signal.SIGKILL
        pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 2
        assert wait_until(lambda: gone(pids), timeout=20), "servers outlived their client"
    finally:
        client.kill()
        for pid in [int(p) for p in pid_file.read_text().split()] if pid_file.exists() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --- CUDA ---------------------------------------------------------------------------------------
def test_servers_on_cuda_generate_like_the_local_model(checkpoint):
    """Blocks and KV caches on the GPU (hidden states travel through the CPU, as over a network)."""
    directory, _ = checkpoint
    local = shards.load_decoder(directory, device="cuda").eval()
    ids = prompt_ids(seed=12)
    expected = generate.generate(local, ids.cuda(), 10)
    with swarm.Swarm(directory, [(0, 2), (2, 4)], timeout=120, device="cuda", start_method="spawn") as sw:
        assert [info["device"] for info in sw.info] == ["cuda:0", "cuda:0"]
        client = swarm.Client(sw, device="cuda")  # embeddings and head on the GPU, as the local model's
        assert torch.equal(client.generate(ids, 10), expected)
        with client.inference_session() as session:
            session.step(client.embed(ids))
            assert sw.request(0, "info")["cache_bytes"] == 2 * 2 * ids.shape[0] * ids.shape[1] * 32 * 4
