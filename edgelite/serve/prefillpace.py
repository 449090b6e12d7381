"""How much of a prompt a scheduler step prefills beside the running replies' decode steps.

A prompt chunk costs more the longer the context it attends over: 64 tokens at the end of a
6,000-token SmolLM2 prompt made each step of the replies running beside it 4.6x as long (their
time between tokens p99 8.8x). The pace learns from the steps as they run: a step that carries
a chunk and decode rows should take at most `slowdown` times a step of decode rows alone (an
average of recent ones); past that the chunk halves, well under it it doubles again, between
`least` and `most` tokens. A step with no decode rows beside it prefills `most`: nobody waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMA = 0.2  # weight of a new decode-only step in the average


@dataclass
class PrefillPace:
    most: int  # GatewayConfig.prefill_chunk_tokens
    least: int  # GatewayConfig.prefill_min_chunk_tokens
    slowdown: float  # GatewayConfig.prefill_slowdown
    chunk: int = field(init=False)  # the chunk a step beside decode rows prefills now
    plain_ms: float | None = None  # a step of decode rows alone, on average

    def __post_init__(self) -> None:
        self.chunk = self.most

    def size(self, decoding: bool) -> int:
        """The chunk of this step: `chunk` with decode rows beside it, else `most`."""
        return self.chunk if decoding else self.most

    def timed(self, prefilled: bool, decoded: bool, ms: float) -> None:
        """A step took `ms`: it prefilled a chunk (`prefilled`) and/or ran decode rows."""
        if decoded and not prefilled:
            self.plain_ms = ms if self.plain_ms is None else (1 - EMA) * self.plain_ms + EMA * ms
        elif decoded and self.plain_ms is not None:
            if ms > self.slowdown * self.plain_ms:
                self.chunk = max(self.least, self.chunk // 2)
            elif ms < 0.5 * self.slowdown * self.plain_ms:
                self.chunk = min(self.most, self.chunk * 2)
