"""Speculative decoding: drafts of what may follow the reply, and how many to offer.

A round: a drafter proposes up to k tokens that may follow the reply so far; one step feeds
the reply's last token and the drafts through the model at once (`Backend.verify`), the reply
loop keeps the drafts the model agrees with (`ReplyLoop.verify`: the output is the model's
own, greedy or sampled), and the session gives back the positions of the rest
(`Backend.rollback`, carried by the next step). One round trip through the pipeline then
yields 1 + accepted tokens, and a decode step on each stage reads its weights once for all of
them.

Drafters: `Lookup` (prompt lookup: the tokens that followed the latest earlier occurrence of
the reply's last n-gram, in the prompt or the reply; no model, strong where the reply copies
its input: summaries, rewrites, code edits, answers from a given text) and `DraftModel` (a
small export with the same tokenizer, run on this device).

`Pacer` picks k each round: the expected tokens of a round, (1 - a^(k+1)) / (1 - a) for the
running acceptance rate a, over the round's time: a step of k + 1 positions (measured as they
run, seeded from the plan's prediction: the links' time per round trip, and the stages'
compute, which grows little with the positions while a decode step is memory-bound), plus
the draft model's k steps. k = 0 (a plain step) where nothing pays, e.g. on loopback with no
draft that is often right.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edgelite.config import MAX_ROLLBACK

# a draft token from a draft model's logits, by the reply's own settings: (token, the
# distribution it was drawn from, None when chosen outright); ReplyLoop.draw
Draw = Callable[[np.ndarray], tuple[int, "np.ndarray | None"]]


class DraftBackend(Protocol):
    """What a draft model runs on (client/local.py's LocalBackend)."""

    async def forward(self, session: str, ids: np.ndarray) -> np.ndarray: ...
    async def rollback(self, session: str, n: int) -> None: ...
    async def end(self, session: str) -> None: ...
    async def close(self) -> None: ...

# the positions a verification step runs (its chunk: engine/runtime.chunks_of pads a step to
# the next prefill chunk size), and so the drafts worth offering: k + 1 of them fill it
WIDTHS = (1, 4, 16)
# a step of w positions against one of 1, for the stages' compute (memory-bound decode: the
# weights are read once), before any is measured
GROWTH = {1: 1.0, 4: 1.4, 16: 2.6}
DECAY = 0.85  # the running figures' weight on the past, per round
EXPLORE = 0.8  # a width never run is tried once when its expected rate is this near the best
PRIOR_ROUNDS = 2.0  # a reply starts from the model's acceptance so far, worth this many rounds


def width(drafts: int) -> int:
    """The positions a step verifying `drafts` runs: the narrowest of WIDTHS that holds them."""
    return next(w for w in WIDTHS if w >= drafts + 1)


@dataclass
class Draft:
    """A round's proposal: the tokens, and (a sampled draft) the distribution each was drawn
    from (None: chosen outright, as greedy drafts and lookups are)."""

    tokens: list[int]
    q: list[np.ndarray] | None = None
    kind: int = 0  # what the pacer keeps its acceptance under (a lookup: the n-gram matched)


class Lookup:
    """Prompt lookup over a reply's tokens (the prompt and what was generated): n-grams of
    `min_ngram`..`max_ngram` tokens indexed by their latest earlier occurrence."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest occurrence ends
        self.seen = 0  # tokens indexed

    def propose(self, tokens: Sequence[int], k: int) -> Draft:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of `tokens` seen before (`tokens` only grows between calls of one reply)."""
        n = len(tokens)
        for end in range(max(self.seen, 1), n):  # every n-gram that has a following token
            for size in self.sizes:
                if end >= size:
                    self.index[tuple(tokens[end - size:end])] = end
        self.seen = max(self.seen, n)
        for size in self.sizes:
            if n >= size and (at := self.index.get(tuple(tokens[n - size:]))) is not None:
                return Draft(list(tokens[at:at + k]), kind=size)
        return Draft([])


class DraftModel:
    """A small model with the target's tokenizer, run on this device (its own backend, its
    own thread) to draft k tokens a round. It keeps one session per reply in step with the
    reply: what the target refused is rolled back, or the session computed again."""

    def __init__(self, backend: DraftBackend) -> None:
        self.backend = backend
        self.fed: dict[str, list[int]] = {}  # session -> the tokens its KV holds
        # session -> how many of them were the reply's own when last asked: the reply only
        # grows, so they still agree and the comparison starts after them
        self.agreed: dict[str, int] = {}
        self.step_ms = 0.0  # running ms of one draft token (the Pacer's input)

    async def prepare(self, session: str, prompt: Sequence[int]) -> None:
        """Compute the prompt on the draft (beside the model's own prefill, so the first
        round does not wait for it)."""
        await self._catch_up(session, list(prompt))

    async def propose(self, session: str, tokens: Sequence[int], k: int, draw: Draw) -> Draft:
        """k drafts after `tokens`, each drawn by `draw` from the draft's logits."""
        logits = await self._catch_up(session, list(tokens))
        out, qs = [], []
        for i in range(k):
            tok, q = draw(logits)
            out.append(tok)
            qs.append(q)
            if i + 1 < k:
                logits = await self._step(session, [tok])
                self.fed[session].append(tok)
        sampled = [q for q in qs if q is not None]
        return Draft(out, sampled if len(sampled) == len(qs) else None)

    async def _step(self, session: str, ids: list[int]) -> np.ndarray:
        """A step of the draft; one of a token or two is timed (the pacer's draft cost)."""
        t0 = asyncio.get_running_loop().time()
        logits = await self.backend.forward(session, np.array([ids], np.int64))
        if len(ids) <= 2:
            ms = (asyncio.get_running_loop().time() - t0) * 1e3
            self.step_ms = ms if not self.step_ms else DECAY * self.step_ms + (1 - DECAY) * ms
        return logits

    async def _catch_up(self, session: str, tokens: list[int]) -> np.ndarray:
        """The draft's logits after `tokens`: its session rolled back to what it shares with
        them (or ended, past kv.MAX_ROLLBACK) and fed the rest."""
        fed, lo = self.fed.get(session, []), self.agreed.get(session, 0)
        same = next((i for i in range(lo, min(len(fed), len(tokens))) if fed[i] != tokens[i]),
                    min(len(fed), len(tokens)))
        same = min(same, len(tokens) - 1)  # (at least the last token is fed: its logits)
        if fed and (same < len(fed) - MAX_ROLLBACK or same == 0):
            await self.backend.end(session)
            fed, same = [], 0
        elif same < len(fed):
            await self.backend.rollback(session, same)
        self.fed[session], self.agreed[session] = tokens, len(tokens)
        return await self._step(session, tokens[same:])

    async def end(self, session: str) -> None:
        self.agreed.pop(session, None)
        if self.fed.pop(session, None) is not None:
            await self.backend.end(session)

    async def close(self) -> None:
        await self.backend.close()


@dataclass
class Speculation:
    """How replies speculate: with `draft` (None: prompt lookup), paced by `pacer` (shared
    by the replies of one model, so it learns across them)."""

    pacer: Pacer
    draft: DraftModel | None = None


@dataclass
class Pacer:
    """How many drafts to offer each round (see the module's docstring). `step_ms`: a plain
    step's time as the plan predicts it; `compute_ms`: the part of it the stages compute."""

    step_ms: float = 0.0  # (0: learnt from the first plain step)
    compute_ms: float = 0.0
    # running counts behind the acceptance rate, per kind of draft (prior: 1 of 2)
    accepted: dict[int, float] = field(default_factory=dict)
    refused: dict[int, float] = field(default_factory=dict)
    times: dict[int, float] = field(default_factory=dict)  # width -> running ms of a step
    measured: set[int] = field(default_factory=set)  # widths whose time was measured
    parent: Pacer | None = None  # (a reply's: the model's pacer, which learns from it too)

    def __post_init__(self) -> None:
        if self.step_ms > 0:
            self._prior(self.step_ms, self.compute_ms)

    def _prior(self, step_ms: float, compute_ms: float) -> None:
        self.times.update({w: step_ms + compute_ms * (GROWTH[w] - 1.0) for w in WIDTHS})

    def fork(self) -> Pacer:
        """A reply's own pacer: the step times shared with this one; the acceptance its own,
        starting from this one's (worth PRIOR_ROUNDS rounds: a reply that copies its input and
        one that does not differ more than any two figures of one reply), and taught to both."""
        child = Pacer(parent=self)
        child.times, child.measured = self.times, self.measured
        for kind in self.accepted:
            a = self.acceptance(kind)
            child.accepted[kind], child.refused[kind] = PRIOR_ROUNDS * a, PRIOR_ROUNDS * (1 - a)
        return child

    def acceptance(self, kind: int = 0) -> float:
        a, r = self.accepted.get(kind, 1.0), self.refused.get(kind, 1.0)
        return a / (a + r)

    def k(self, draft_ms: float = 0.0, kind: int = 0, most: int = WIDTHS[-1] - 1) -> int:
        """The drafts to ask for this round (0: a plain step), for a draft of `kind` costing
        `draft_ms` a token, of which at most `most` are at hand (a lookup's match: a step
        wider than they fill costs more and yields nothing more)."""
        if not self.times:  # nothing known yet: a plain step first (observe learns from it)
            return 0
        a = min(self.acceptance(kind), 0.999)
        rates: dict[int, float] = {}  # drafts -> expected tokens a ms, each in its narrowest step
        for w in WIDTHS:
            k = min(w - 1, most)
            if k not in rates:
                rates[k] = (1 - a ** (k + 1)) / (1 - a) / (self.times[w] + k * draft_ms)
        best = max(rates, key=rates.__getitem__)
        # a width never run that is nearly as good is tried once (its time is a prior only)
        untried = [k for k in rates if width(k) not in self.measured and rates[k] >= EXPLORE * rates[best]]
        return untried[0] if untried else best

    def shadow(self, draft: int, token: int, kind: int = 0) -> None:
        """A free draft's first token against the token a plain step chose (prompt lookup
        costs nothing to ask: its acceptance is followed while it is not used)."""
        self.judged(1, int(draft == token), kind)

    def observe(self, offered: int, accepted: int, ms: float, compute_ms: float | None = None,
                kind: int = 0) -> None:
        """A round's outcome: drafts offered and accepted, the step's ms, and of them the
        stages' compute (None: all of it, or unknown)."""
        self.timed(offered, ms, compute_ms)
        self.judged(offered, accepted, kind)

    def timed(self, offered: int, ms: float, compute_ms: float | None = None) -> None:
        """A step that verified `offered` drafts (0: a plain step) took `ms`."""
        w = width(offered)
        if not self.times:  # no plan's prediction: from this step, and its stages' compute
            self._prior(ms, ms if compute_ms is None else compute_ms)
        self.times[w] = DECAY * self.times[w] + (1 - DECAY) * ms
        self.measured.add(w)

    def judged(self, offered: int, accepted: int, kind: int = 0) -> None:
        """Of `offered` drafts of `kind`, the first `accepted` were taken."""
        if offered:
            self.accepted[kind] = DECAY * self.accepted.get(kind, 1.0) + accepted
            self.refused[kind] = DECAY * self.refused.get(kind, 1.0) + (accepted < offered)
            if self.parent is not None:
                self.parent.judged(offered, accepted, kind)
