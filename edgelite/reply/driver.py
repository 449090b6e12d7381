"""One reply's life as a sans-io object: what to send the model next and what its answer
means, with no awaiting and no backend in it (as h11's `Connection` is for HTTP). `generate`
(reply/generate.py) drives one to the end; the gateway (serve/gateway.py) drives many, one
call each per scheduler step; `embed` (reply/embed.py) drives an embedding's.

A driver keeps what the session holds (`fed`: the ids whose KV it has, in order) and what it
must still be fed before the next token (`pending`). The caller:
1. may import a stored prefix first: `wanted()` ids to look up in the KV stores, then
   `imported(n)` with how many were imported;
2. until `done`: `call = next_call(chunk)` (the next prefill chunk, or a decode step with the
   drafts a lookup or a draft model offers), runs it on the backend (`call.kind`: step, verify
   or hidden) and gives the result to `took(call, result)`, which returns the pieces to emit
   and, when drafts were refused, the positions the session keeps (`Backend.rollback`);
3. if the first step after an import fails because a stage could not use the KV it had found
   (backend.stored_kv_failed), ends the session and calls `unusable()`: the driver computes
   it all again;
4. when the reply is preempted or its node lost, stores `fed` if it likes and calls `reset()`
   (the session is gone: everything is fed again, from the stores or computed);
5. at the end stores `fed` (what the session's KV holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from edgelite.reply.loop import Piece, ReplyLoop
from edgelite.reply.speculate import WIDTHS, Draft, Lookup, Pacer

CallKind = Literal["forward", "verify", "hidden"]


class Pooling(Protocol):
    """Where an embedding's hidden states go (reply/embed.py's Pool)."""

    def add(self, rows: np.ndarray) -> None: ...
    def reset(self) -> None: ...


@dataclass(frozen=True)
class Call:
    """One backend call a reply needs: `ids` appended to its session."""

    kind: CallKind  # step: the last position's logits; verify: every position's; hidden: states
    ids: list[int]
    gives: bool  # its result gives the reply's next token(s): a decode step, a prefill's last chunk
    drafts: Draft = field(default_factory=lambda: Draft([]))  # what a verify step checks


@dataclass(frozen=True)
class Outcome:
    """What a call's result made of the reply."""

    pieces: list[Piece]
    accepted: int = 0  # of the call's drafts
    rollback: int | None = None  # the session keeps this many positions (drafts refused)


class ReplyDriver:
    """A reply (`reply`, after `prompt`) or, with `pool`, an embedding of `prompt`. `lookup`
    and `pacer`: prompt lookup's drafts and how many pay (None: no speculation)."""

    def __init__(self, reply: ReplyLoop | None, prompt: list[int], lookup: Lookup | None = None,
                 pacer: Pacer | None = None, pool: Pooling | None = None) -> None:
        if (reply is None) == (pool is None):
            raise ValueError("a driver is a reply's or an embedding's")
        self.reply, self.prompt, self.lookup, self.pacer, self.pool = reply, prompt, lookup, pacer, pool
        self.fed: list[int] = []  # the ids whose KV the session holds
        self.pending: list[int] = list(prompt)  # ids to feed before the next token
        self.restored = 0  # of `fed`: imported from the stores, not yet confirmed by a step
        self.found = Draft([])  # the lookup's last proposal (followed while unused: Pacer.shadow)

    @property
    def tokens(self) -> list[int]:
        """The reply's tokens so far."""
        return self.reply.stats.token_ids if self.reply is not None else []

    @property
    def done(self) -> bool:
        if self.reply is None:
            return not self.pending
        return self.reply.done

    def wanted(self) -> list[int]:
        """What to look up in the KV stores: everything pending but the last id (whose logits
        a step must compute)."""
        return self.pending[:-1]

    def imported(self, n: int) -> None:
        """The first n ids of `wanted()` were imported into the session from the stores."""
        self.fed += self.pending[:n]
        del self.pending[:n]
        self.restored = n
        if self.reply is not None:
            self.reply.stats.reused_tokens = n

    def unusable(self) -> int:
        """The imported KV could not be used after all (the caller ended the session): it is
        all fed again. Returns how many ids had been imported."""
        n = self.restored
        self.reset()
        if self.reply is not None:
            self.reply.stats.reused_tokens = 0
        return n

    def reset(self) -> None:
        """The session is gone (preempted, a node lost, its KV unusable): the prompt and the
        reply so far are pending again; an embedding starts over."""
        self.fed, self.pending, self.restored = [], self.prompt + self.tokens, 0
        if self.pool is not None:
            self.pool.reset()

    def room(self) -> int:
        """How many drafts may follow the next token (past the end of the reply, or wider
        than the widest verification step, they are waste)."""
        assert self.reply is not None
        return min(self.reply.cfg.max_tokens - len(self.tokens) - 1, WIDTHS[-1] - 1)

    def draft_count(self, draft_ms: float) -> int:
        """How many tokens a draft model costing `draft_ms` a token should propose now (0: a
        plain step)."""
        if self.pacer is None or self.reply is None or self.pending:
            return 0
        return min(self.reply.cfg.draft_tokens or self.pacer.k(draft_ms), self.room())

    def next_call(self, chunk: int | None = None, draft: Draft | None = None) -> Call:
        """The next call: up to `chunk` pending ids (None: all of them), or a decode step
        with `draft`'s tokens (a draft model's) or the lookup's."""
        if self.pending:
            ids = self.pending[:chunk] if chunk else list(self.pending)
            del self.pending[:len(ids)]
            kind: CallKind = "hidden" if self.pool is not None else "forward"
            return Call(kind, ids, gives=not self.pending and self.pool is None)
        assert self.reply is not None, "an embedding has nothing to decode"
        offered = draft if draft is not None else self._looked_up()
        if offered.tokens:
            return Call("verify", [self.tokens[-1], *offered.tokens], True, offered)
        return Call("forward", self.tokens[-1:], True)

    def _looked_up(self) -> Draft:
        """The lookup's drafts for this step, as many as the pacer says pay."""
        self.found = Draft([])
        if self.lookup is None or self.pacer is None or self.reply is None:
            return self.found
        left = self.room()
        self.found = self.lookup.propose(self.prompt + self.tokens, left)
        if not self.found.tokens:
            return Draft([])
        found = self.found
        k = min(self.reply.cfg.draft_tokens or self.pacer.k(0.0, found.kind, len(found.tokens)), left)
        return Draft(found.tokens[:k], kind=found.kind)

    def took(self, call: Call, result: np.ndarray) -> Outcome:
        """A call's result: logits (step: the last position's; verify: every position's) or
        hidden states (an embedding's chunk)."""
        self.restored = 0  # (a step ran on what was imported: it was usable)
        if self.pool is not None:
            self.pool.add(result)
            self.fed += call.ids
            return Outcome([])
        assert self.reply is not None
        if not call.gives:  # a prefill chunk before the last
            self.fed += call.ids
            return Outcome([])
        if not call.drafts.tokens:
            self.fed += call.ids
            piece = self.reply.next(result)
            if self.pacer is not None and self.found.tokens:  # (what the unused lookup would have said)
                self.pacer.shadow(self.found.tokens[0], int(np.argmax(result)), self.found.kind)
            self.found = Draft([])
            return Outcome([piece] if piece is not None else [])
        drafts = call.drafts
        pieces, accepted = self.reply.verify(result, drafts.tokens, drafts.q)
        self.fed += call.ids[:1 + accepted]
        if self.pacer is not None:
            self.pacer.judged(len(drafts.tokens), accepted, drafts.kind)
        refused = accepted < len(drafts.tokens) and not self.reply.done
        return Outcome(pieces, accepted, len(self.fed) if refused else None)
