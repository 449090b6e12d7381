"""`edgelite serve`: many users' requests through one cluster, ordered by the scheduler.

Clients speak the wire protocol and authenticate as a user from users.json (HMAC with that
user's own token); the user's tier comes from the file, never from the client. A request is
{type: generate, id, messages | prompt, max_tokens, temperature?}; the gateway streams
{type: token, id, text} frames and ends with {type: done, id, ...figures} or {type: error, id}.

Each scheduler step becomes backend calls: admitted requests prefill their prompt, resumed ones
recompute prompt + generated tokens (their KV was dropped when they were preempted), running
ones decode one token; all of a step's calls go through the pipeline at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgelite.config import GatewayConfig, WireLimits
from edgelite.engine.generate import Backend
from edgelite.engine.sampling import sample
from edgelite.engine.tokenizer import StreamDecoder, Tokenizer
from edgelite.errors import AuthError, EdgeliteError, ProtocolError
from edgelite.net import wire
from edgelite.serve.scheduler import Request, Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class User:
    name: str
    token: str
    tier: int


def load_users(path: Path) -> dict[str, User]:
    """users.json: {"users": [{"name", "token", "tier"}]} (tier 0 = lowest)."""
    try:
        raw = json.loads(path.read_text())
        users = [User(str(u["name"]), str(u["token"]), int(u["tier"])) for u in raw["users"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EdgeliteError(f"{path}: not a users file ({exc!r}); expected "
                            f'{{"users": [{{"name", "token", "tier"}}]}}') from exc
    if any(u.tier < 0 for u in users) or len({u.name for u in users}) != len(users):
        raise EdgeliteError(f"{path}: user names must be unique and tiers >= 0")
    return {u.name: u for u in users}


@dataclass(eq=False)
class Job:
    """One client request: the scheduler's Request plus what the gateway needs to serve it."""

    req: Request
    conn: wire.Conn
    rid: Any
    user: User
    prompt: list[int]
    temperature: float
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    decoder: StreamDecoder | None = None
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    gone: bool = False  # the client disconnected

    @property
    def session(self) -> str:
        return f"gw-{self.req.rid}"


@dataclass
class TierStats:
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    preemptions: int = 0
    done: int = 0

    def to_json(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float:
            return round(float(np.percentile(xs, q)), 2) if xs else 0.0

        return {"done": self.done, "preemptions": self.preemptions,
                "ttft_ms_p50": pct(self.ttft_ms, 50), "ttft_ms_p99": pct(self.ttft_ms, 99),
                "itl_ms_p50": pct(self.itl_ms, 50), "itl_ms_p99": pct(self.itl_ms, 99),
                "itl_ms_mean": round(statistics.fmean(self.itl_ms), 2) if self.itl_ms else 0.0}


class Gateway:
    def __init__(self, backend: Backend, tok: Tokenizer, users: dict[str, User],
                 scheduler: Scheduler, cfg: GatewayConfig | None = None,
                 limits: WireLimits | None = None) -> None:
        self.backend, self.tok, self.users, self.sched = backend, tok, users, scheduler
        self.cfg, self.limits = cfg or GatewayConfig(), limits or WireLimits()
        self.jobs: dict[str, Job] = {}  # scheduler rid -> job
        self.tiers: dict[int, TierStats] = {}
        self.wake = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.eos = set(backend.manifest.eos_token_ids)
        self._ids = 0

    @property
    def port(self) -> int:
        return wire.bound_port(self.server)

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, self.cfg.host, self.cfg.port)

    async def run(self) -> None:
        if self.server is None:
            await self.start()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.server.serve_forever())
            tg.create_task(self._loop())

    # ---- clients -------------------------------------------------------------------------
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = "{}:{}".format(*writer.get_extra_info("peername")[:2])
        conn = wire.Conn(reader, writer, self.limits, peer)
        try:
            auth = await asyncio.wait_for(
                wire.server_handshake(conn, self._secret, "edgelite-gateway", [
                    self.backend.manifest.fingerprint]), self.cfg.handshake_timeout_s)
            user = self.users[auth["user"]]
            while True:
                try:
                    msg = await asyncio.wait_for(conn.recv(), self.cfg.idle_timeout_s)
                except asyncio.IncompleteReadError:
                    return
                try:
                    await self._request(conn, user, msg)
                except EdgeliteError as exc:
                    await conn.send({"type": "error", "id": msg.get("id"), "message": str(exc)})
        except (AuthError, ProtocolError) as exc:
            log.warning("%s: %s; closing", peer, exc)
            await _try_send(conn, {"type": "error", "message": str(exc)})
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            log.debug("%s: connection ended: %r", peer, exc)
        finally:
            for job in self.jobs.values():  # nobody to stream to: stop at the next token
                if job.conn is conn:
                    job.gone = True
            await conn.close()

    def _secret(self, auth: dict[str, Any]) -> str | None:
        user = self.users.get(auth.get("user"))  # type: ignore[arg-type]
        return user.token if user else None

    async def _request(self, conn: wire.Conn, user: User, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "stats":
            await conn.send({"type": "stats_ok", "id": msg.get("id"), **self.stats()})
            return
        if kind != "generate":
            raise ProtocolError(f"unknown message type {kind!r}")
        prompt = self._prompt(msg)
        max_tokens = msg.get("max_tokens", 128)
        temperature = msg.get("temperature", 0.0)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= self.cfg.max_tokens_limit:
            raise ProtocolError(f"max_tokens must be 1-{self.cfg.max_tokens_limit}")
        if not isinstance(temperature, int | float) or not 0 <= temperature <= 5:
            raise ProtocolError("temperature must be a number in 0-5")
        self._ids += 1
        req = Request(f"{user.name}-{self._ids}", user.tier, len(prompt), max_tokens, time.monotonic())
        try:
            self.sched.submit(req)
        except ValueError as exc:
            raise EdgeliteError(str(exc)) from exc
        self.jobs[req.rid] = Job(req, conn, msg.get("id"), user, prompt, float(temperature),
                                 decoder=StreamDecoder(self.tok))
        self.wake.set()

    def _prompt(self, msg: dict[str, Any]) -> list[int]:
        messages, text = msg.get("messages"), msg.get("prompt")
        if isinstance(messages, list) and all(
                isinstance(m, dict) and isinstance(m.get("content"), str)
                and m.get("role") in ("system", "user", "assistant") for m in messages):
            chat = messages
        elif isinstance(text, str):
            chat = [{"role": "user", "content": text}]
        else:
            raise ProtocolError("generate needs messages [{role, content}] or a prompt string")
        size = sum(len(m["content"]) for m in chat)
        if size > self.cfg.max_prompt_chars:
            raise ProtocolError(f"prompt of {size} characters exceeds {self.cfg.max_prompt_chars}")
        return self.tok.chat_prompt(chat)

    # ---- the scheduling loop -------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            d = self.sched.step(time.monotonic())
            for r in d.preempt:
                job = self.jobs[r.rid]
                self._tier(job).preemptions += 1
                log.info("preempted %s (tier %d) after %d tokens; its KV is dropped and will "
                         "be recomputed", r.rid, r.tier, r.generated)
                await self.backend.end(job.session)
            if d.idle:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), self.cfg.idle_poll_s)
                except TimeoutError:
                    pass
                continue
            work = ([(r, self.jobs[r.rid].prompt) for r in d.admit]
                    + [(r, self.jobs[r.rid].prompt + self.jobs[r.rid].tokens) for r in d.resume]
                    + [(r, self.jobs[r.rid].tokens[-1:]) for r in d.decode])
            results = await asyncio.gather(
                *(self.backend.step(self.jobs[r.rid].session, np.array([ids], np.int64))
                  for r, ids in work), return_exceptions=True)
            for (r, _), logits in zip(work, results, strict=True):
                await self._deliver(self.jobs[r.rid], logits)

    async def _deliver(self, job: Job, logits: np.ndarray | BaseException) -> None:
        r = job.req
        if isinstance(logits, BaseException):
            if not isinstance(logits, EdgeliteError):
                raise logits
            log.warning("request %s failed: %s", r.rid, logits)
            self.sched.advance(r, done=True)
            await self._finish(job, error=str(logits))
            return
        tok = sample(logits, job.temperature, 1.0, job.rng)
        now = time.monotonic()
        eos = tok in self.eos
        if not eos:
            job.tokens.append(tok)
            job.token_times.append(now)
            assert job.decoder is not None
            await _try_send(job.conn, {"type": "token", "id": job.rid, "text": job.decoder.push(tok)})
        self.sched.advance(r, done=eos or job.gone)
        if r.queue == "finished":
            await self._finish(job)

    async def _finish(self, job: Job, error: str | None = None) -> None:
        del self.jobs[job.req.rid]
        await self.backend.end(job.session)
        st = self._tier(job)
        t = job.token_times
        if t:
            st.ttft_ms.append((t[0] - job.req.arrival) * 1e3)
            st.itl_ms.extend(float(x) * 1e3 for x in np.diff(t))
        st.done += 1
        if error is not None:
            await _try_send(job.conn, {"type": "error", "id": job.rid, "message": error})
            return
        await _try_send(job.conn, {
            "type": "done", "id": job.rid, "token_ids": job.tokens, "tier": job.user.tier,
            "ttft_ms": round((t[0] - job.req.arrival) * 1e3, 2) if t else None,
            "preemptions": job.req.preemptions,
            "decode_tok_s": round((len(t) - 1) / (t[-1] - t[0]), 2) if len(t) > 1 and t[-1] > t[0] else 0.0})

    def _tier(self, job: Job) -> TierStats:
        return self.tiers.setdefault(job.user.tier, TierStats())

    def stats(self) -> dict[str, Any]:
        s = self.sched
        queues = {"waiting": s.waiting(), "running": s.running, "preempted": s.preempted_list()}
        per_tier = {str(t): {q: sum(1 for r in rs if r.tier == t) for q, rs in queues.items()}
                    for t in sorted({u.tier for u in self.users.values()})}
        return {"queues": {q: len(rs) for q, rs in queues.items()}, "queues_by_tier": per_tier,
                "kv_tokens": {"used": s.kv_used, "budget": s.cfg.kv_tokens},
                "tiers": {str(t): st.to_json() for t, st in sorted(self.tiers.items())}}


async def _try_send(conn: wire.Conn, msg: dict[str, Any]) -> None:
    try:
        await conn.send(msg)
    except (ConnectionError, OSError):
        log.debug("%s: client gone; %s dropped", conn.peer, msg.get("type"))
