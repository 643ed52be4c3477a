"""Did the data really travel? Replaying the message transcripts of assignment 1 (trusted side).

The value tests compare every rank's result with a one-process reference, and the budget tests
count bytes and messages. Neither proves that the result was *computed from the messages*: a
submission that rebuilds every rank's input on its own (a child process can read the job's
``spec.json`` and ``workers.py``) returns the right sum with no messages at all, or with dummy
messages of exactly the budgeted sizes. Each rank's ``StudentComm`` therefore records a
transcript (``grader/student_comm.py``: a copy of every message sent, and every receive when it
completes), and this module replays the transcripts of all ranks together:

1. **What each message carries.** A message of a reduction or a broadcast must be a slice of a
   sum of some ranks' inputs, ``sum over W of x_w[o : o + L]`` (flattened, within the rounding
   of ``|W|`` additions); a message of an allgather must be whole inputs, one after the other.
   A message that is neither (zeros, noise, a stale buffer) fails: "not any sum of the inputs".
2. **Causality.** A rank can only send what it has: its own input, and what messages it has
   *already received* brought it. The replay keeps, per rank and per element, the set of ranks
   whose data has reached that element (a bit mask), and fails a message whose ``W`` holds a
   rank whose data had not arrived there. A rank that computed the full sum on its own and
   sends it in its first message fails here.
3. **Coverage.** At the end each rank must have received the data its result depends on: every
   rank's, for every element of an allreduce; for its own block, in a reduce-scatter; the
   source's, in a broadcast; every input, in an allgather.

These three are properties of *any* algorithm that computes the collective by communicating,
so the value tests can ask for them without naming an algorithm (a "ring" allreduce that
gathers everything and adds it up still passes them, and fails only its budget). The budget
tests add the schedule of the named algorithm (``check_*_schedule``): which peer, in which
order, with which ranks' data at each step.

Messages between two ranks with the same tag arrive in the order they were posted (the
library's ``_PeerQueue``); the k-th receive a rank posted from (peer, tag) is paired with the
k-th send of that peer to it with that tag. A transcript that contradicts the other ranks' (a
receive no send matches, a size that differs, a cycle of messages received before they were
sent) fails too: the recording was tampered with.
"""

from __future__ import annotations

import math

import pytest
import torch

#: dtypes a message may have (what ``Transcript`` writes): name -> torch dtype
DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "bool",
    )
}
SAMPLE = 16  # elements of a message compared first, against every candidate (offset, W)
MAX_SEARCH = 100_000_000  # subset x offset pairs of the exhaustive search for an unusual slice
SEARCH_BLOCK = 2_000_000  # subset x offset pairs computed at once in that search (memory)
MAX_CANDIDATES = 200_000  # candidate offsets x subsets, 16 sums each cached per length: learning stops there
ORDINALS = {1: "st", 2: "nd", 3: "rd"}


def ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else ORDINALS.get(k % 10, 'th')}"


def ranks_of(mask: int) -> list[int]:
    return [rank for rank in range(mask.bit_length()) if mask >> rank & 1]


class Message:
    """One event of a transcript, validated: ``op``, ``peer``, ``tag``, ``dtype``, ``numel``,
    and for a send its values (float64) and for a receive its ``index``."""

    def __init__(self, op: str, peer: int, tag: int, dtype: torch.dtype, numel: int) -> None:
        self.op, self.peer, self.tag, self.dtype, self.numel = op, peer, tag, dtype, numel
        self.values: torch.Tensor | None = None
        self.index = -1
        self.match: list[tuple[int, int, int]] | None = None  # what a send may be, its sender having it
        self.segments: list[int] | None = None  # allgather: the rank of each whole input sent
        self.candidates: list[tuple[int, int, int]] = []  # every (mask, offset, length) it may be


def parse(where: str, p: int, transcript) -> list[Message]:
    """A rank's transcript as read back from the sandbox, checked field by field."""
    if not isinstance(transcript, dict) or not isinstance(transcript.get("events"), list):
        pytest.fail(f"{where}: a report without a message transcript", pytrace=False)
    data = transcript.get("data")
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        pytest.fail(f"{where}: a message transcript without its bytes", pytrace=False)
    messages, offset = [], 0
    for event in transcript["events"]:
        fields = event if isinstance(event, dict) else {}
        op, peer, tag, numel = (fields.get(key) for key in ("op", "peer", "tag", "numel"))
        dtype = DTYPES.get(fields.get("dtype")) if isinstance(fields.get("dtype"), str) else None
        ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (peer, tag, numel))
        if op not in ("send", "recv") or dtype is None or not ints or not 0 <= peer < p or numel < 0:
            pytest.fail(f"{where}: a malformed event in the message transcript", pytrace=False)
        message = Message(op, peer, tag, dtype, numel)
        if op == "send":
            size = numel * torch.empty(0, dtype=dtype).element_size()
            if fields.get("offset") != offset or offset + size > data.numel():
                pytest.fail(f"{where}: the message transcript's bytes do not add up", pytrace=False)
            raw = data[offset : offset + size]
            message.values = (raw.view(dtype) if size else torch.empty(0, dtype=dtype)).double()
            offset += size
        else:
            if not isinstance(fields.get("index"), int) or fields["index"] < 0:
                pytest.fail(f"{where}: a malformed event in the message transcript", pytrace=False)
            message.index = fields["index"]
        messages.append(message)
    if offset != data.numel():
        pytest.fail(f"{where}: the message transcript's bytes do not add up", pytrace=False)
    return messages


def candidate_offsets(n: int, p: int) -> list[int]:
    """Where a slice of the flattened tensor may start: the boundaries of ``chunk_offsets(n, q)``
    (the given helper) and of ``torch.chunk`` for q = 1 .. 2p, and of repeated halving (floor
    and ceiling midpoints), which is how every reasonable ring or butterfly cuts the tensor."""
    offsets = {0}
    for q in range(1, 2 * p + 1):
        base, extra = divmod(n, q)
        offsets.update(i * base + min(i, extra) for i in range(q + 1))
        step = math.ceil(n / q) if n else 0
        offsets.update(min(i * step, n) for i in range(q + 1))
    ranges = [(0, n)]
    for _ in range(max(p, 2).bit_length()):
        ranges = [
            half
            for lo, hi in ranges
            for mid in {(lo + hi) // 2, (lo + hi + 1) // 2}
            for half in ((lo, mid), (mid, hi))
        ]
        offsets.update(lo for lo, _ in ranges)
    return sorted(o for o in offsets if 0 <= o <= n)


class Identifier:
    """Which sum of which inputs, at which offset, a message's values are.

    ``X`` holds every rank's input, flattened, in float64 (``p x n``); ``eps`` is the machine
    epsilon of the inputs' dtype (0 for integers: sums must be exact). A sum over ``W`` may
    differ from the exact one by ``|W| eps sum_w |x_w| + eps |sum|`` per element, the bound the
    value tests allow a result.
    """

    def __init__(self, X: torch.Tensor, eps: float) -> None:
        self.X, self.eps = X, eps
        self.p, self.n = X.shape
        self.absX = X.abs()
        self.masks = torch.arange(1, 2**self.p)
        self.A = ((self.masks[:, None] >> torch.arange(self.p)) & 1).double()  # subsets x ranks
        self.sizes = self.A.sum(1)
        self.offsets = candidate_offsets(self.n, self.p)
        self._known = set(self.offsets)
        self._cache: dict[int, tuple] = {}

    def _at_candidates(self, length: int) -> tuple:
        """Per length: the sample positions, the candidate offsets, and every subset's sums there."""
        if length not in self._cache:
            k = min(length, SAMPLE)
            sample = torch.linspace(0, length - 1, k).round().long()
            offsets = torch.tensor([o for o in self.offsets if o + length <= self.n], dtype=torch.long)
            positions = offsets[:, None] + sample[None, :]  # O x k
            sums = torch.einsum("sp,pok->osk", self.A, self.X[:, positions])
            abs_sums = torch.einsum("sp,pok->osk", self.A, self.absX[:, positions])
            rows = torch.arange(len(self.masks))
            tol = self.sizes[rows][None, :, None] * self.eps * abs_sums + self.eps * sums.abs() + 1e-300
            first = (sums[:, :, 0].contiguous(), tol[:, :, 0].contiguous())  # the first filter's
            self._cache[length] = (sample, offsets, sums, tol, first)
        return self._cache[length]

    def _verify(self, row: int, offset: int, values: torch.Tensor) -> bool:
        piece = slice(offset, offset + values.numel())
        exact = self.A[row] @ self.X[:, piece]
        tol = self.sizes[row] * self.eps * (self.A[row] @ self.absX[:, piece]) + self.eps * exact.abs()
        return bool(((values - exact).abs() <= tol + 1e-300).all())

    def identify(self, values: torch.Tensor) -> list[tuple[int, int, int]]:
        """Every (mask of W, offset, length) the values are, within rounding; [] if none."""
        length = values.numel()
        if length == 0:
            return [(0, 0, 0)]  # carries nothing
        if length > self.n or not torch.isfinite(values).all():
            return []
        sample, offsets, sums, tol, (sums0, tol0) = self._at_candidates(length)
        at = values[sample]
        # the first sampled element against every (offset, subset), then the rest on what matches
        o, row = ((sums0 - at[0]).abs_() <= tol0).nonzero().unbind(1)
        close = ((sums[o, row] - at).abs() <= tol[o, row]).all(-1)
        pairs = torch.stack([o[close], row[close]], 1).tolist()
        if length <= SAMPLE:  # the sample is the whole message: nothing more to verify
            found = [(int(self.masks[row]), int(offsets[o]), length) for o, row in pairs]
        else:
            found = [
                (int(self.masks[row]), int(offsets[o]), length)
                for o, row in pairs[:64]
                if self._verify(row, int(offsets[o]), values)
            ]
        found = found or self._search(values)
        self._learn(found)
        return found

    def _learn(self, found: list[tuple[int, int, int]]) -> None:
        """Where a message was found to start and end become candidate offsets: the next message
        cut at the same boundary, or the next piece of a chunk sent in pieces, is then found among
        the candidates, with no search. (Messages that match at several offsets -- tiny ones of
        small integers -- teach nothing.) Learning stops at ``MAX_CANDIDATES`` offset x subset
        pairs, so that the sums cached per message length stay within about 60 MB; past that,
        unusual offsets are searched for each time (slower, never refused)."""
        if len({offset for _, offset, _ in found}) != 1:
            return
        _, offset, length = found[0]
        new = {o for o in (offset, offset + length) if o < self.n} - self._known
        if new and (len(self._known) + len(new)) * len(self.masks) <= MAX_CANDIDATES:
            self._known |= new
            self.offsets = sorted(self._known)
            self._cache.clear()

    def _search(self, values: torch.Tensor, known: torch.Tensor | None = None) -> list[tuple[int, int, int]]:
        """An unusual slice: every offset, for every subset (in blocks, to bound memory).

        ``known`` (the sender's per-element masks of what has reached it): keep only the sums the
        sender could have had -- the last resort before a causality failure, where the first
        matches of a tiny message of small integers may all be chance ones.

        What it finds joins the candidate offsets (``_learn``), so an implementation that cuts
        at unusual boundaries pays one search per boundary, not one per message. Only past
        ``MAX_SEARCH`` pairs (for example 8 ranks on more than 4e5 elements; no a1 test has one:
        the largest is 6 ranks x 1,000,003, 6.3e7 pairs) is the search narrowed to the single
        inputs and the full sum.
        """
        length, starts = values.numel(), self.n - values.numel() + 1
        rows = torch.arange(len(self.masks))
        if len(rows) * starts > MAX_SEARCH:
            rows = torch.tensor([r for r in range(len(self.masks)) if self.sizes[r] in (1, self.p)])
        A, block = self.A[rows], max(1, SEARCH_BLOCK // len(rows))
        others = sorted({0, length // 2, length - 1})  # checked where the first element may match
        # a first, cheap filter: one bound, twice over, on any subset's tolerance at any element
        # (|W| eps sum|x_w| + eps |sum| <= (p + 1) eps sum_w max|x_w|); each candidate's own follows
        loose = 2 * (self.p + 1) * self.eps * float(self.absX.amax(1).sum())
        found: list[tuple[int, int, int]] = []
        for lo in range(0, starts, block):
            hi = min(starts, lo + block)
            first = A @ self.X[:, lo:hi]
            first.sub_(values[0]).abs_()
            r, o = (first <= loose + 1e-300).nonzero().unbind(1)
            del first
            for j in others:  # the exact tolerance; small integers match the first element in many places
                at = self.X[:, lo + o + j].T  # candidates x p
                sums = (A[r] * at).sum(1)
                bound = self.sizes[rows[r]] * self.eps * (A[r] * at.abs()).sum(1) + self.eps * sums.abs()
                keep = (sums - values[j]).abs() <= bound + 1e-300
                r, o = r[keep], o[keep]
            if known is not None:
                r, o = _admissible(self.masks[rows[r]], lo + o, length, known, r, o)
            for row, offset in zip(rows[r][:64].tolist(), (lo + o[:64]).tolist()):
                if len(found) < 64 and self._verify(row, offset, values):
                    found.append((int(self.masks[row]), offset, length))
        return found


def whole_inputs(X: torch.Tensor, values: torch.Tensor) -> list[int] | None:
    """An allgather message as the ranks whose whole inputs it is, in order; None if it is not."""
    p, n = X.shape
    if n == 0:
        return [] if values.numel() == 0 else None
    if values.numel() % n:
        return None
    ranks = []
    for segment in values.view(-1, n):
        same = [r for r in range(p) if torch.equal(segment, X[r])]
        if not same:
            return None
        ranks.append(same[0])
    return ranks


def replay(
    function: str,
    p: int,
    where: str,
    transcripts: list,
    inputs: list[torch.Tensor],
    src: int | None,
) -> list[list[Message]]:
    """Check what every message carries, causality and coverage (module docstring); return each
    rank's messages with what was found in them (for the schedule checks of the budget tests).

    Runs on one torch thread: most of its operations are small (10^4 to 10^5 elements in one
    identification), and on a machine whose cores are busy (the grader's other jobs, a CI run)
    two threads made one identification 30 times slower than one (7 ms against 0.24 ms,
    measured under load).
    """
    threads = torch.get_num_threads()
    if threads == 1:  # the grader's process (grade.main), whose checks run in several threads
        return _replay(function, p, where, transcripts, inputs, src)
    torch.set_num_threads(1)
    try:
        return _replay(function, p, where, transcripts, inputs, src)
    finally:
        torch.set_num_threads(threads)


def _replay(function, p, where, transcripts, inputs, src) -> list[list[Message]]:
    X = torch.stack([x.reshape(-1).double() for x in inputs]) if inputs else torch.zeros(0, 0)
    n = X.shape[1]
    dtype = inputs[0].dtype
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    gather = function == "ring_allgather"
    identifier = None if gather else Identifier(X, eps)
    ranks = [parse(f"{where}: rank {r}", p, transcripts[r]) for r in range(p)]
    sends: dict[tuple[int, int, int], list[Message]] = {}
    for r, messages in enumerate(ranks):
        for k, message in enumerate(m for m in messages if m.op == "send"):
            what = f"{where}: rank {r}'s {ordinal(k + 1)} message (to rank {message.peer}, "
            what += f"{message.numel} values)"
            if gather:
                message.segments = whole_inputs(X, message.values)
                if message.segments is None:
                    pytest.fail(f"{what} is not any rank's whole input: dummy data?", pytrace=False)
            else:
                message.candidates = identifier.identify(message.values)
                if not message.candidates:
                    pytest.fail(
                        f"{what} is not any sum of the ranks' inputs (nor a slice of one): dummy data? "
                        "The result must be computed from what the messages carry.",
                        pytrace=False,
                    )
            sends.setdefault((r, message.peer, message.tag), []).append(message)
    # knowledge per rank: per element, a bit mask of the ranks whose data reached it; in an
    # allgather, the set of whole inputs the rank holds
    known = [torch.full((n,), 1 << r, dtype=torch.int64) for r in range(p)]
    held = [{r} for r in range(p)]
    position = [0] * p
    while any(position[r] < len(ranks[r]) for r in range(p)):
        progress = False
        for r, messages in enumerate(ranks):
            while position[r] < len(messages):
                message = messages[position[r]]
                if message.op == "send":
                    k = sum(1 for m in messages[: position[r] + 1] if m.op == "send")
                    what = f"{where}: rank {r}'s {ordinal(k)} message (to rank {message.peer})"
                    if gather:
                        _send_held(message, held[r], what)
                    else:
                        _send_sum(message, known[r], what, identifier)
                else:
                    sent = _paired(message, sends, r, where)
                    if sent.match is None and sent.segments is None:
                        break  # its sender has not got that far in the replay yet
                    if gather:
                        held[r].update(sent.segments)
                    else:
                        for mask, offset, length in sent.match:
                            known[r][offset : offset + length] |= mask
                position[r] += 1
                progress = True
        if not progress:
            pytest.fail(
                f"{where}: the ranks' transcripts contradict each other (a message received before it "
                "was sent): the recording was changed",
                pytrace=False,
            )
    _coverage(function, p, where, known, held, n, src)
    return ranks


def _paired(message: Message, sends: dict, r: int, where: str) -> Message:
    """The send that ``message`` (a receive of rank ``r``) received."""
    paired = sends.get((message.peer, r, message.tag), [])
    if message.index >= len(paired) or paired[message.index].numel != message.numel:
        pytest.fail(
            f"{where}: rank {r} received a message from rank {message.peer} that rank {message.peer}'s "
            "transcript does not hold: the recording was changed",
            pytrace=False,
        )
    return paired[message.index]


def _admissible(masks, offsets, length, known, *keep):
    """``keep`` where the sum over ``masks`` at ``offsets`` had reached its sender (``known``)."""
    if len(masks) < length:  # few candidates of a long message: one slice per candidate
        ok = torch.tensor(
            [
                bool(((known[o : o + length] & m) == m).all())
                for m, o in zip(masks.tolist(), offsets.tolist())
            ],
            dtype=torch.bool,
        )
        return tuple(k[ok] for k in keep)
    ok = torch.ones(len(masks), dtype=torch.bool)
    for j in range(length):  # many candidates of a short message: one position at a time
        ok &= (known[offsets + j] & masks) == masks
        if not ok.any():
            break
    return tuple(k[ok] for k in keep)


def _send_sum(message: Message, known: torch.Tensor, what: str, identifier: Identifier) -> None:
    """Keep the candidates the sender could have had. Tiny messages of small integers can be
    several sums at once; the receiver then learns all of them (lenient). If none is left, every
    offset and subset is searched once more for sums the sender had, before the message fails."""
    message.match = [
        (mask, offset, length)
        for mask, offset, length in message.candidates
        if not (known[offset : offset + length] & mask != mask).any()
    ]
    if not message.match and message.values is not None:
        message.match = identifier._search(message.values, known)
    if message.match:
        return
    mask, offset, length = message.candidates[0]
    missing = mask & ~int(torch.bitwise_and(known[offset : offset + length], mask).min()) if length else 0
    pytest.fail(
        f"{what} carries data of rank(s) {ranks_of(missing) or ranks_of(mask)} that had not reached it "
        "in any message it received before: it cannot have been computed from messages",
        pytrace=False,
    )


def _send_held(message: Message, held: set[int], what: str) -> None:
    unknown = [rank for rank in message.segments if rank not in held]
    if unknown:
        pytest.fail(
            f"{what} carries the input of rank {unknown[0]}, which no message had brought it yet: "
            "it cannot have been computed from messages",
            pytrace=False,
        )


def _coverage(function: str, p: int, where: str, known: list, held: list, n: int, src: int | None) -> None:
    """Every rank must have received the data its result depends on."""
    if p == 1 or n == 0:
        return
    everyone = (1 << p) - 1
    for r in range(p):
        if function == "ring_allgather":
            missing = sorted(set(range(p)) - held[r])
            if missing:
                pytest.fail(
                    f"{where}: rank {r} returned rank {missing[0]}'s input, but no message brought it "
                    "there: the result was not computed from messages",
                    pytrace=False,
                )
            continue
        if function == "tree_broadcast":
            need, region = 1 << src, slice(0, n)
        elif function == "ring_reduce_scatter":
            block = n // p
            need, region = everyone, slice(r * block, (r + 1) * block)
        else:
            need, region = everyone, slice(0, n)
        short = (known[r][region] & need) != need
        if short.any():
            element = int(short.nonzero()[0]) + (region.start or 0)
            lacking = ranks_of(need & ~int(known[r][element]))
            pytest.fail(
                f"{where}: rank {r}'s result needs the data of rank(s) {lacking} at element {element} "
                "of the flattened tensor, and no message it received carried it: the result was not "
                "computed from messages",
                pytrace=False,
            )
