"""One client request as the gateway holds it (`Job`), and where its events go (`Sink`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from edgelite.ids import SessionId, new_session_id
from edgelite.reply.driver import Call, ReplyDriver
from edgelite.reply.embed import Pool
from edgelite.reply.loop import Piece
from edgelite.serve.events import Event, Token
from edgelite.serve.scheduler import Request
from edgelite.serve.users import User


class Sink(Protocol):
    """Where a request's events go: a wire client (`serve/native.py`), or an HTTP request
    (`serve/http.py`).
    `gone` set: its requests are cancelled at the next step."""

    user: User
    peer: str
    gone: bool

    def post(self, event: Event) -> None: ...


@dataclass(eq=False)
class Job:
    """One client request: the scheduler's Request, its reply's driver (reply/driver.py: what
    the request sends next, what its session holds), and what the gateway needs to serve it."""

    req: Request
    client: Sink
    rid: int
    driver: ReplyDriver
    session: SessionId = field(default_factory=new_session_id)
    swapped: int = 0  # tokens whose KV it stored when it was last preempted
    reused: bool = False  # what it imported is a stored prefix of its prompt (not its own swap)
    prefill_waits: int = 0  # steps in a row its prefill was left out (over the step's budget)
    cancelled: bool = False  # its client said stop (generate_cancel): dropped at the next step
    tail: str = ""  # text its reply loop held back until the end (sent with Done)
    call: Call | None = None  # its call in this step
    pool: Pool | None = None  # an embedding's sums (Ask.embedding): its steps give hidden states

    @property
    def prompt(self) -> list[int]:
        return self.driver.prompt

    @property
    def tokens(self) -> list[int]:
        return self.driver.tokens

    def emit(self, piece: Piece) -> None:
        """A piece to the client (text held back to the end goes with Done)."""
        if piece.token_id is None:
            self.tail = piece.text
        else:
            self.client.post(Token(self.rid, piece))
