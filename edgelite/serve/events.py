"""What the gateway tells a request's client, as plain data: a token's piece, the end of a
reply, an embedding, or a failure. The doors turn them into their own formats: the native
door into wire messages (serve/native.py), the OpenAI door into OpenAI's JSON
(serve/openai.py)."""

from __future__ import annotations

from dataclasses import dataclass

from edgelite.reply.loop import Piece


@dataclass(frozen=True)
class Token:
    """One piece of a reply's text, with its token (piece.token_id) and its log probabilities."""

    rid: int
    piece: Piece


@dataclass(frozen=True)
class Finished:
    """A reply's end: its tokens and figures, and text held back until now."""

    rid: int
    token_ids: list[int]
    finish: str  # eos, stop, length or tool_calls
    tier: int
    preemptions: int
    prompt_tokens: int
    ttft_ms: float | None
    decode_tok_s: float
    text: str = ""
    tool_call: str = ""  # finish tool_calls: JSON text of {"name", "arguments"}


@dataclass(frozen=True)
class Embedded:
    """An embedding's vector (reply/embed.py)."""

    rid: int
    vector: list[float]
    prompt_tokens: int
    tier: int


@dataclass(frozen=True)
class Failed:
    """A request that ends in an error (a one-line message)."""

    rid: int
    message: str


Event = Token | Finished | Embedded | Failed
