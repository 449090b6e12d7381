"""One reply's token loop: the rules every way of asking the model shares.

The logits of a reply's next position go in; a `Piece` comes out: the token sampled
(temperature and top-p, from the reply's own seeded generator) and the text it adds, once its
UTF-8 characters are whole and nothing of it could still be the start of a stop string. The
loop also decides where the reply ends: at an end-of-sequence token ("eos": the token is not
part of the reply), at a stop string ("stop": the text ends before it; the token that completed
it is the last id), or after `max_tokens` tokens ("length"); and it keeps the reply's figures
(time to first token, decode speed). `reply/generate.py` drives one for a session on a backend
(the library, `generate` and `chat`); the gateway drives one per request in its batched steps
(both of its front doors). Nothing else samples, matches stop strings or tests for EOS.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgelite.config import GenerationConfig
from edgelite.errors import EdgeliteError
from edgelite.manifest import Manifest
from edgelite.reply.jsonprefix import JsonConstraint
from edgelite.reply.jsonschema import check_reply_schema
from edgelite.reply.sampling import distribution, log_normalizer, sample
from edgelite.reply.tokenizer import StreamDecoder
from edgelite.reply.tools import CallChooser, check_choice, parse_call, parse_tools
from edgelite.topk import largest

FINISHES = ("eos", "stop", "length", "tool_calls")


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it adds (may be empty while UTF-8 is incomplete or
    the text could begin a stop string). A last piece without a token flushes held text."""

    text: str
    token_id: int | None
    # with GenerationConfig.logprobs >= 0: the token's log probability (after penalties,
    # before temperature) and the likeliest alternatives, (id, log probability) each
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Stats:
    """A reply's figures; `finish` is one of FINISHES."""

    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    reused_tokens: int = 0  # prompt tokens whose KV came from the KV stores
    ttft_ms: float = 0.0  # from the start given to the ReplyLoop to the first token
    decode_s: float = 0.0  # from the first token to the last
    finish: str = "length"
    token_times: list[float] = field(default_factory=list)  # time.monotonic() of each token
    steps: int = 0  # steps that gave tokens (the prompt's, decode steps, verifications)
    tool_call: str = ""  # finish "tool_calls": the call, JSON text of {"name", "arguments"}
    drafted: int = 0  # draft tokens offered for verification (speculation)
    accepted: int = 0  # of them accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens per round trip through the model (1 without speculation)."""
        return len(self.token_ids) / self.steps if self.steps else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = len(self.token_ids) - 1  # the first token comes from prefill
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0


class StopMatcher:
    """Passes text on while holding back what could be the start of a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.held = stops, ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, text: str) -> tuple[str, bool]:
        """-> (text that may be shown now, whether a stop string was reached)."""
        self.held += text
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.held = self.held[:cut], ""
            return out, True
        keep = _could_begin(self.held, self.stops, self.hold)
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out, False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def _could_begin(text: str, stops: tuple[str, ...], hold: int) -> int:
    """How many characters at the end of `text` could begin a stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text), hold), 0, -1)
                if text.endswith(s[:k])), default=0)


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def parse_schema(text: str) -> dict[str, Any]:
    """A reply's JSON schema (json_schema, as JSON text), checked against the subset taken."""
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        raise EdgeliteError(f"json_schema is not JSON: {exc}") from None
    return check_reply_schema(parsed)


def constrained(cfg: GenerationConfig) -> bool:
    """A reply held to JSON or that may be a tool call: its tokens are chosen one by one (the
    reply loop's JsonConstraint or CallChooser), so it does not speculate."""
    return cfg.response_format != "text" or bool(cfg.tools and cfg.tool_choice != "none")


def check(cfg: GenerationConfig) -> GenerationConfig:
    """The options, or a one-line error naming the first one out of its range."""
    _check_values(cfg)
    if cfg.response_format == "json_schema":
        parse_schema(cfg.json_schema)
    if cfg.tools:
        check_choice(cfg.tool_choice, parse_tools(cfg.tools))
    return cfg


def _check_values(cfg: GenerationConfig) -> None:
    """check() but the schema (a reply loop parses that once, for its own use)."""
    if cfg.max_tokens < 1:
        raise EdgeliteError(f"max_tokens must be at least 1 (got {cfg.max_tokens})")
    if not (math.isfinite(cfg.temperature) and cfg.temperature >= 0):
        raise EdgeliteError(f"temperature must be 0 (greedy) or more (got {cfg.temperature:g})")
    if not 0.0 < cfg.top_p <= 1.0:
        raise EdgeliteError(f"top_p must be within 0 (excluded) and 1 (got {cfg.top_p:g})")
    if cfg.response_format not in RESPONSE_FORMATS:
        raise EdgeliteError(f"response_format must be one of {', '.join(RESPONSE_FORMATS)} "
                            f"(got {cfg.response_format[:32]!r})")
    if cfg.top_k < 0 or not 0.0 <= cfg.min_p <= 1.0 or not cfg.repetition_penalty > 0:
        raise EdgeliteError(f"top_k must be >= 0, min_p within 0..1 and repetition_penalty > 0 "
                            f"(got {cfg.top_k}, {cfg.min_p:g}, {cfg.repetition_penalty:g})")


class ReplyLoop:
    """The token loop of one reply; `next` per position until `done`.

    `decoder` turns ids into text (None: no text, ids only); `started` is when the reply was
    asked for (time.monotonic(); the time to first token counts from it)."""

    def __init__(self, cfg: GenerationConfig, eos: Collection[int],
                 decoder: StreamDecoder | None = None, started: float | None = None,
                 stats: Stats | None = None, prompt: Sequence[int] = ()) -> None:
        _check_values(cfg)
        self.cfg, self.eos, self.decoder = cfg, frozenset(eos), decoder
        self.started = time.monotonic() if started is None else started
        self.stats = stats if stats is not None else Stats()
        self.rng = np.random.default_rng(cfg.seed if cfg.seed is not None else secrets.randbits(64))
        self.stops = StopMatcher(cfg.stop)
        self.finish: str | None = None
        self.uses: Counter[int] = Counter()  # the reply's tokens, for the penalties
        self.seen = set(prompt) if cfg.repetition_penalty != 1.0 else set()  # (and the prompt's)
        self.json: JsonConstraint | None = None
        if cfg.response_format != "text":
            if decoder is None:
                raise EdgeliteError(f"response_format {cfg.response_format} needs the reply's "
                                    f"text (a tokenizer)")
            self.json = JsonConstraint(decoder.tok.decode, self.eos,
                                       schema=parse_schema(cfg.json_schema)
                                       if cfg.response_format == "json_schema" else None,
                                       token_bytes=decoder.tok.token_bytes, limit_s=cfg.constraint_token_s)
        # a reply that may be a tool call (reply/tools.py): its text is held while it may
        self.tools: CallChooser | None = None
        self.held = ""
        if cfg.tools and cfg.tool_choice != "none":
            if decoder is None or self.json is not None:
                raise EdgeliteError("tools need the reply's text (a tokenizer) and no "
                                    "response_format")
            tools = parse_tools(cfg.tools)
            check_choice(cfg.tool_choice, tools)
            self.tools = CallChooser(decoder.tok.decode, self.eos, tools, cfg.tool_choice,
                                     decoder.tok.tool_style, token_bytes=decoder.tok.token_bytes,
                                     limit_s=cfg.constraint_token_s)

    @property
    def done(self) -> bool:
        return self.finish is not None

    def next(self, logits: np.ndarray) -> Piece | None:
        """The next token from its logits (vocab,): the piece to show (None: nothing, the
        reply ended at EOS with no text held back). Check `done` afterwards."""
        if self.done:
            raise EdgeliteError(f"the reply already ended ({self.finish})")
        self.stats.steps += 1
        logits = self._penalised(logits)
        cfg = self.cfg

        def pick(row: np.ndarray) -> int:
            return sample(row, cfg.temperature, cfg.top_p, self.rng, cfg.top_k, cfg.min_p)

        if self.json:
            return self._take(self.json.choose(logits, pick), logits)
        if self.tools:
            return self._take(self.tools.choose(logits, pick), logits)
        return self._take(pick(logits), logits)

    def verify(self, logits: np.ndarray, drafts: list[int],
               q: list[np.ndarray] | None = None) -> tuple[list[Piece], int]:
        """A speculative step's outcome. `logits` (len(drafts) + 1, vocab): every position of
        the step that fed the reply's last token and then the drafts. Drafts are taken in
        order while the rule accepts them (greedy: each must be the most likely token;
        sampling: drawn with probability min(1, p/q), q the draft's distribution, or 1 for a
        draft chosen outright), then one token is chosen where the first was refused (from
        the residual max(0, p - q)) or after the last: the reply's distribution is the model's
        own. Returns the pieces and the drafts accepted; stops where the reply ends."""
        if self.done:
            raise EdgeliteError(f"the reply already ended ({self.finish})")
        if self.json or self.tools:
            raise EdgeliteError("a reply held to JSON or tools chooses its tokens one by one "
                                "(no speculation)")
        st = self.stats
        st.steps += 1
        st.drafted += len(drafts)
        pieces: list[Piece] = []
        for i, draft in enumerate([*drafts, None]):
            row = self._penalised(logits[i])  # (the tokens taken so far count)
            tok = self._judge(row, draft, q[i] if q is not None and draft is not None else None)
            piece = self._take(tok, row)
            if piece is not None:
                pieces.append(piece)
            if tok == draft:
                st.accepted += 1
            if tok != draft or self.done:
                return pieces, i + (tok == draft)
        raise AssertionError("unreachable: the last position has no draft")

    def draw(self, logits: np.ndarray, vocab: int) -> tuple[int, np.ndarray | None]:
        """A draft model's token by this reply's settings: (token, the distribution over the
        model's `vocab` tokens it was drawn from; None when greedy, chosen outright)."""
        if self.cfg.temperature <= 0:
            return int(np.argmax(logits)), None
        cfg = self.cfg
        q = distribution(logits, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)
        if len(q) != vocab:  # (a padded table may differ in size: only common ids are drawn)
            q = np.pad(q[:vocab], (0, max(0, vocab - len(q))))
            q /= q.sum()
        return int(self.rng.choice(len(q), p=q)), q

    def _judge(self, logits: np.ndarray, draft: int | None, q: np.ndarray | None) -> int:
        """The token at a verified position: `draft` if the rule accepts it (None: no draft
        here), else the model's choice given that it was refused."""
        cfg = self.cfg
        if cfg.temperature <= 0:
            return int(np.argmax(logits))
        p = distribution(logits, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)
        if draft is None:
            return int(self.rng.choice(len(p), p=p))
        q_draft = 1.0 if q is None else float(q[draft])
        if self.rng.random() * q_draft < p[draft]:  # (u < p / q, without dividing by 0)
            return draft
        rest = np.maximum(p - q, 0.0) if q is not None else p.copy()
        if q is None:
            rest[draft] = 0.0
        total = rest.sum()
        if total <= 0:  # (p == q: a refusal has probability 0; guard against rounding)
            rest, total = p, 1.0
        return int(self.rng.choice(len(rest), p=rest / total))

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        """The logits with the penalties applied (the same array when there are none)."""
        cfg = self.cfg
        if cfg.repetition_penalty != 1.0 and (self.seen or self.uses):
            logits = logits.copy()
            ids = np.fromiter(self.seen | self.uses.keys(), np.int64)
            row = logits[ids]
            logits[ids] = np.where(row > 0, row / cfg.repetition_penalty, row * cfg.repetition_penalty)
        if (cfg.presence_penalty or cfg.frequency_penalty) and self.uses:
            logits = logits.copy() if cfg.repetition_penalty == 1.0 else logits
            ids = np.fromiter(self.uses.keys(), np.int64, len(self.uses))
            counts = np.fromiter(self.uses.values(), np.float64, len(self.uses))
            logits[ids] -= (cfg.presence_penalty + cfg.frequency_penalty * counts).astype(logits.dtype)
        return logits

    def _take(self, tok: int, logits: np.ndarray | None = None) -> Piece | None:
        """The reply's next token is `tok` (chosen from `logits`, for its log probability):
        its piece, and whether the reply ended there."""
        if tok in self.eos:
            tail = self._end("eos")
            return Piece(tail, None) if tail else None
        st, now = self.stats, time.monotonic()
        if not st.token_ids:
            st.ttft_ms = (now - self.started) * 1e3
        st.token_ids.append(tok)
        st.token_times.append(now)
        st.decode_s = now - st.token_times[0]
        text = self.decoder.push(tok) if self.decoder else ""
        if self.tools is not None and (self.tools.state != "text" or self.held):
            self.held += text  # (held while the reply may be a tool call)
            text = ""
            if self.tools.state == "text":
                text, self.held = self.held, ""
        if self.tools is not None and self.tools.done:
            self.stats.tool_call = json.dumps(parse_call(self.tools.call_text), ensure_ascii=False)
            self.held = ""
            self._set("tool_calls")
            text = ""
        else:
            text, stopped = self.stops.push(text)
            if stopped:
                self._set("stop")
            elif len(st.token_ids) >= self.cfg.max_tokens:
                text += self._end("length")
        self.uses[tok] += 1
        if self.cfg.logprobs < 0 or logits is None:
            return Piece(text, tok)
        norm = log_normalizer(logits)
        top = largest(logits, self.cfg.logprobs)  # (largest first)
        return Piece(text, tok, float(logits[tok]) - norm,
                     tuple((int(t), float(logits[t]) - norm) for t in top))

    def _set(self, finish: str) -> None:
        self.finish = self.stats.finish = finish

    def _end(self, finish: str) -> str:
        """End the reply (`finish`, unless its last text completes a stop string): the text
        held back until now (an incomplete character, what could have begun a stop string)."""
        held, self.held = self.held, ""  # (a call cut short: its text is the reply's)
        tail, stopped = self.stops.push(held + (self.decoder.flush() if self.decoder else ""))
        self._set("stop" if stopped else finish)
        return tail + self.stops.flush()


def fitted(cfg: GenerationConfig, prompt: int, limit: int, m: Manifest,
           less: str) -> GenerationConfig:
    """The settings of a reply to a `prompt`-token prompt where a session holds at most
    `limit` positions: max_tokens cut to what fits after the prompt (the reply then ends with
    finish "length"). A prompt that does not fit is refused, naming whose limit it is: the
    model's, or (`less`) what holds fewer positions than the model."""
    if prompt >= limit:
        whose = (f"the model's context ({m.name}: {m.max_positions} positions)"
                 if limit >= m.max_positions else f"{less} ({limit} positions: --kv-buckets)")
        raise EdgeliteError(f"the prompt has {prompt} tokens; {whose} takes at most {limit - 1} "
                            f"and a reply")
    return dataclasses.replace(cfg, max_tokens=min(cfg.max_tokens, limit - prompt))
