"""Whether a text can still become one JSON object: a character-level pushdown automaton,
fed as a reply grows, for `response_format: json_object` (reply/loop.py masks each token
whose text would make the reply anything else).

It accepts exactly the prefixes of texts `json.loads` reads as an object (with whitespace
around; numbers of at most MAX_NUMBER characters), checks strings' escapes (`\\uXXXX` too),
numbers' grammar and the literals, and says when the object is complete. Pure Python: it
runs in Termux as it runs here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from edgelite.errors import EdgeliteError
from edgelite.reply.jsonschema import fits, pending

T = TypeVar("T")
WHITESPACE = " \t\n\r"
MAX_WHITESPACE = 8  # characters of whitespace in a row between tokens of the JSON (outside strings)
MAX_NUMBER = 32  # characters of a number, once it is whole (then it ends: a model's digits may not)
# the second byte's range for the leads that narrow it (UTF-8: no overlong forms, no surrogates)
SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
MAX_PARTIAL = 3  # tokens in a row that leave a character incomplete (UTF-8: 4 bytes at most)
PENDING_BYTES = b"\x80"  # stands for a character's bytes still coming where they are not known
ESCAPES = '"\\/bfnrtu'
HEX = "0123456789abcdefABCDEF"
LITERALS = ("true", "false", "null")


@dataclass
class JsonPrefix:
    """The state after the text fed so far. `stack`: the open containers ('{' or '['); `mode`:
    what the next character may be:

    value: a value starts (or, in an array just opened, `]`); key: a key or `}` (just after
    `{`), key!: a key (after a comma); colon; after: `,` or the container's close;
    string/escape/hex1..4: inside a string (`key` tells it is a key); number states; a literal
    being spelled (`lit`, `pos`); done: the top-level object closed (whitespace only)."""

    stack: list[str] = field(default_factory=list)
    mode: str = "start"
    key: bool = False
    lit: str = ""
    pos: int = 0
    number: str = ""

    def copy(self) -> JsonPrefix:
        return JsonPrefix(list(self.stack), self.mode, self.key, self.lit, self.pos, self.number)

    @property
    def done(self) -> bool:
        return self.mode == "done"

    @property
    def in_string(self) -> bool:
        return self.mode in ("string", "escape") or self.mode.startswith("hex")

    def feed(self, text: str) -> bool:
        """Take `text` if the result can still become a JSON object (True); else leave the
        state as it was (False)."""
        saved = self.copy()
        for ch in text:
            if not self._char(ch):
                self.__dict__.update(saved.__dict__)
                return False
        return True

    # ---- one character -------------------------------------------------------------------
    def _char(self, ch: str) -> bool:
        mode = self.mode
        if mode in ("num_int", "num_zero", "num_frac", "num_exp"):
            if len(self.number) < MAX_NUMBER and self._number(ch):
                return True
            self.mode = "after" if self.stack else "done"  # the number ended: go on with ch
            mode = self.mode
            if mode == "done":
                return ch in WHITESPACE
        if mode in ("num_minus", "num_dot", "num_e", "num_esign"):
            return self._number(ch)
        if mode == "start":
            if ch in WHITESPACE:
                return True
            if ch == "{":
                self.stack.append("{")
                self.mode = "key"
                return True
            return False
        if mode == "done":
            return ch in WHITESPACE
        if mode == "string" or mode == "escape" or mode.startswith("hex"):
            return self._string(ch)
        if mode == "lit":
            if ch != self.lit[self.pos]:
                return False
            self.pos += 1
            if self.pos == len(self.lit):
                self.mode = "after"
            return True
        if ch in WHITESPACE:
            return True
        if mode in ("key", "key!"):
            if ch == '"':
                self.mode, self.key = "string", True
                return True
            if ch == "}" and mode == "key":
                return self._close("{")
            return False
        if mode == "colon":
            if ch == ":":
                self.mode = "value"
                return True
            return False
        if mode in ("value", "value]"):
            if ch == "]" and mode == "value]":
                return self._close("[")
            return self._value(ch)
        if mode == "after":
            top = self.stack[-1]
            if ch == ",":
                self.mode = "key!" if top == "{" else "value"
                return True
            if ch in "}]":
                return self._close(ch.replace("}", "{").replace("]", "["))
            return False
        return False

    def _value(self, ch: str) -> bool:
        if ch == "{":
            self.stack.append("{")
            self.mode = "key"
        elif ch == "[":
            self.stack.append("[")
            self.mode = "value]"
        elif ch == '"':
            self.mode, self.key = "string", False
        elif ch == "-":
            self.mode, self.number = "num_minus", ch
        elif ch == "0":
            self.mode, self.number = "num_zero", ch
        elif ch.isdigit() and ch.isascii():
            self.mode, self.number = "num_int", ch
        else:
            for word in LITERALS:
                if ch == word[0]:
                    self.mode, self.lit, self.pos = "lit", word, 1
                    return True
            return False
        return True

    def _close(self, opener: str) -> bool:
        if not self.stack or self.stack[-1] != opener:
            return False
        self.stack.pop()
        self.mode = "after" if self.stack else "done"
        return True

    def _string(self, ch: str) -> bool:
        mode = self.mode
        if mode == "escape":
            if ch not in ESCAPES:
                return False
            self.mode = "hex1" if ch == "u" else "string"
            return True
        if mode.startswith("hex"):
            if ch not in HEX:
                return False
            n = int(mode[3])
            self.mode = "string" if n == 4 else f"hex{n + 1}"
            return True
        if ch == "\\":
            self.mode = "escape"
            return True
        if ch == '"':
            self.mode = "colon" if self.key else "after"
            return True
        return ch >= " "  # (control characters must be escaped)

    def _number(self, ch: str) -> bool:
        mode, digit = self.mode, ch.isdigit() and ch.isascii()
        nxt = None
        if mode == "num_minus":
            nxt = "num_zero" if ch == "0" else "num_int" if digit else None
        elif mode == "num_int":
            nxt = "num_int" if digit else "num_dot" if ch == "." else "num_e" if ch in "eE" else None
        elif mode == "num_zero":
            nxt = "num_dot" if ch == "." else "num_e" if ch in "eE" else None
        elif mode in ("num_dot", "num_frac"):
            nxt = "num_frac" if digit else ("num_e" if ch in "eE" and mode == "num_frac" else None)
        elif mode in ("num_e", "num_esign"):
            nxt = "num_exp" if digit else ("num_esign" if ch in "+-" and mode == "num_e" else None)
        elif mode == "num_exp":
            nxt = "num_exp" if digit else None
        if nxt is None:
            return False
        self.mode, self.number = nxt, self.number + ch
        return True


def incomplete(data: bytes) -> bytes | None:
    """The bytes at the end of `data` that begin a UTF-8 character still to be completed
    (b"": none), or None when they can begin none (continuation bytes with no lead, a byte no
    character starts with, a second byte outside its lead's range)."""
    conts = 0
    while conts < min(3, len(data)) and 0x80 <= data[-1 - conts] < 0xC0:
        conts += 1
    if conts == len(data):
        return None if data else b""
    lead, have = data[-1 - conts], conts + 1
    if lead < 0x80:
        return b"" if not conts else None
    if not 0xC2 <= lead <= 0xF4:
        return None
    need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    if have >= need:
        return b"" if have == need else None
    low, high = SECOND_BYTE.get(lead, (0x80, 0xBF))
    return data[-have:] if have == 1 or low <= data[-have + 1] <= high else None


class Budget:
    """The time one token's choice may take: `check` raises once it is spent (looked at every
    CHECK_EVERY calls: a call is one candidate token weighed)."""

    CHECK_EVERY = 64

    def __init__(self, limit_s: float, what: str) -> None:
        self.end, self.limit_s, self.what, self.calls = time.monotonic() + limit_s, limit_s, what, 0

    def check(self) -> None:
        self.calls += 1
        if self.calls % self.CHECK_EVERY == 0 and time.monotonic() > self.end:
            raise EdgeliteError(f"{self.what} took over {self.limit_s:g} s choosing one token (its schema "
                                f"weighs too much against this model's vocabulary)")


def draw_allowed(logits: np.ndarray, pick: Callable[[np.ndarray], int],
                 allowed: Callable[[int], T | None], tries: int) -> tuple[int, T] | None:
    """The token `pick` takes from the logits with every token `allowed` refused (None)
    masked out, drawn again up to `tries` times: (token, what `allowed` said), or None. A draw
    after masking is a draw from the masked distribution."""
    masked = np.array(logits, dtype=np.float32, copy=True)
    for _ in range(tries):
        tok = pick(masked)
        if (said := allowed(tok)) is not None:
            return tok, said
        masked[tok] = -np.inf
    return None


def likeliest_first(logits: np.ndarray) -> list[int]:
    """Every token, the likeliest first (the full scan after `draw_allowed`)."""
    return np.argsort(-np.asarray(logits, dtype=np.float32), kind="stable").tolist()


class JsonConstraint:
    """Chooses a reply's tokens so that it is one JSON object: the token `pick` (argmax, or a
    draw by the reply's settings) takes from the logits with every token found invalid masked
    out, trying again until one keeps the text a JSON object's prefix; an end-of-sequence
    token only once the object is complete, and the reply ends as soon as it is. Drawing
    again after masking is drawing from the masked distribution, so sampling keeps the
    model's distribution over the tokens allowed. After `max_tries` refusals every token is
    checked (a rare full scan)."""

    def __init__(self, decode: Callable[[list[int]], str], eos: frozenset[int],
                 max_tries: int = 64, schema: dict[str, Any] | None = None,
                 ids: Sequence[int] = (), skip: int = 0,
                 token_bytes: Callable[[int], bytes] | None = None, limit_s: float = math.inf) -> None:
        self.decode, self.eos, self.max_tries = decode, eos, max_tries
        self.limit_s = limit_s  # one token's choice at most (GenerationConfig.constraint_token_s)
        # each token's bytes (Tokenizer.token_bytes; None: not known): a token that leaves a
        # character incomplete is taken only if its bytes can begin one the schema allows
        self.token_bytes = token_bytes
        self.schema = schema  # json_schema: the text must also stay within it (jsonschema.py)
        self.partial = 0  # tokens in a row that left a character incomplete
        self.state = JsonPrefix()
        # the reply's tokens so far; the JSON starts `skip` characters into their text (a
        # tool call's opening comes before it: reply/tools.py)
        self.ids, self.skip = list(ids), skip
        self.decoded = decode(self.ids) if self.ids else ""  # the reply's tokens' text
        # the bytes of a character the tokens so far leave incomplete (token_bytes known)
        self.pending = b""
        head = self.decoded[skip:]
        # the JSON's text the state has taken; `started`: what came with `ids` can begin it
        self.text = head
        self.started = (not head.endswith("\ufffd") and self.state.feed(head)
                        and (schema is None or fits(schema, head)))

    def _fits(self, tok: int, any_space: bool = False) -> tuple[str, bytes] | None:
        """(the text `tok` adds to the reply, the bytes it leaves of a character still
        incomplete) when it keeps the reply a JSON object's prefix, else None. A character
        left incomplete (its bytes go on in the next token) is taken with the token that
        completes it, only inside a string (elsewhere no non-ASCII character is JSON) and only
        where its bytes can begin one the schema allows. `any_space`: whitespace beyond
        MAX_WHITESPACE is taken too."""
        if tok in self.eos:
            return None
        got = self._piece(tok) if self.token_bytes is not None else self._decoded(tok)
        if got is None:
            return None  # (bytes that cannot make a character; a token that adds none)
        new, tail = got
        partial = bool(tail)
        after = self.state.copy()
        if not after.feed(new) or (partial and not after.in_string):
            return None
        if not new and not partial:
            return None  # (a token that adds no text would not advance the reply)
        if partial and self.partial >= MAX_PARTIAL:
            return None  # (bytes that never make a character)
        if not new.strip(WHITESPACE) and not after.in_string and not any_space:
            run = len(self.text) - len(self.text.rstrip(WHITESPACE)) + len(new)
            if run > MAX_WHITESPACE:
                return None  # (whitespace only would never end the object)
        coming = pending(tail if self.token_bytes is not None else b"") if partial else ""
        if self.schema is not None and not fits(self.schema, self.text + new + coming):
            return None
        return new, tail

    def _piece(self, tok: int) -> tuple[str, bytes] | None:
        """From the token's bytes (no decoding of the reply): (the text it completes, the
        bytes it leaves incomplete), or None when they cannot be text or it adds none."""
        assert self.token_bytes is not None
        own = self.token_bytes(tok)
        data = self.pending + own
        tail = incomplete(data)
        if not own or tail is None:
            return None
        try:
            return data[:len(data) - len(tail)].decode(), tail
        except UnicodeDecodeError:
            return None

    def _decoded(self, tok: int) -> tuple[str, bytes] | None:
        """From the reply's text decoded with the token (bytes not known): (the text it adds,
        b"\\x80" standing for bytes of a character still coming, or b""), or None."""
        text = self.decode([*self.ids, tok])
        partial = text.endswith("\ufffd")
        new = text[self.skip + len(self.text):].rstrip("\ufffd")
        if "\ufffd" in new or text.endswith("\ufffd\ufffd") or (partial and text == self.decoded):
            return None
        return new, b"" if not partial else PENDING_BYTES

    def choose(self, logits: np.ndarray, pick: Callable[[np.ndarray], int]) -> int:
        if self.state.done:
            return min(self.eos)
        if (drawn := draw_allowed(logits, pick, self._fits, self.max_tries)) is not None:
            return self._accept(drawn[0], *drawn[1])
        order = likeliest_first(logits)
        clock = Budget(self.limit_s, "the JSON constraint")
        for any_space in (False, True):  # (whitespace beyond the cap only if nothing else goes)
            for tok in order:  # every token, the likeliest first
                clock.check()
                if (taken := self._fits(tok, any_space)) is not None:
                    return self._accept(tok, *taken)
        raise EdgeliteError("no token of the model's vocabulary continues the JSON here")

    def _accept(self, tok: int, new: str, tail: bytes) -> int:
        self.partial = self.partial + 1 if tail else 0
        self.state.feed(new)
        self.text += new
        self.ids.append(tok)
        if self.token_bytes is not None:
            self.pending = tail
        else:
            self.decoded = self.decode(self.ids)
        return tok
