"""Three-queue priority scheduler with preemption (pure: no I/O; the clock is passed in).

Queues: waiting (not prefilled), running (decoding, holding KV), preempted (decode interrupted,
KV dropped: it is recomputed from prompt + generated tokens on resume). KV is counted as the
nodes hold it: in capacity buckets (`kv_buckets`; a request holds the smallest bucket that covers
its tokens, and grows a bucket at a time).

Priority = first + second + third:
- first, task difficulty relative to the context limit L: before prefill
  a_prompt * (L - prompt) / L + a_output * (L - max_output) / L; while decoding
  a_decode * (L - remaining) / L (close to done -> higher);
- second, waiting time through the patience threshold: 0 until a request has waited its
  patience (P for tier 0, P * scale**tier above: a higher tier's deadline comes sooner), then
  `slope` per second waited beyond it. It grows equally for every overdue request, so among
  overdue requests the order is fixed by (static priority - slope * deadline): a heap key that
  stays valid as time passes. `slope` is large, so overdue requests go in deadline order (a
  higher tier first when deadlines tie) and every overdue request outranks every new arrival;
- third, the user tier times `w_tier`.

Each step: when the preempted queue is empty (and the scheduling interval has elapsed) admit
waiting requests by priority within the step budget (requests, prefill tokens, KV tokens); a
request too large for the room left now keeps its place while smaller ones behind it are
admitted, until it is overdue: then nothing is admitted around it, and it gets the room as
running requests finish (so a long prompt neither blocks the others nor waits forever); a
step that admits nothing decodes the running requests. With preempted work, decode running and
resume preempted requests as KV memory allows. Decoding needs one more KV token per running
request; when that does not fit, the lowest-priority running request below the preemption cap is
preempted. A request that reached the cap is never preempted again.

Fair shares, within a tier (between tiers, priority decides): with several
users of a tier active (holding waiting, running or preempted requests, or having had one
within `fair_window_s`), a user may run at most max_requests // active users of its tier;
its other waiting requests are passed over meanwhile (they keep their place). When every slot
is taken, a request of a user below its share takes one from the user of its tier furthest
above it: that request goes back to waiting and keeps its tokens.
This is not counted against max_preemptions: its user keeps running its share, so it cannot
starve. While several users of a tier have running requests, each decodes at most
max_requests // those users of them a step (its highest-priority ones); the rest are paused
(KV kept, no token this step), so one user's many requests do not slow everyone's steps.
One user with many requests (a flood, or replies nobody reads) cannot hold everyone else's
slots; alone, a user may use them all.

Waiting bound (what the tests check): an overdue request is never passed by a later-overdue one
and nothing is admitted around it (no backfilling past an overdue head; before its deadline a
request may be passed by smaller ones). Every request ahead of
it (the overdue ones before it and those holding or waiting for KV at its deadline) finishes
within (1 + max_output) * (1 + max_preemptions) steps, so it is admitted within
wait_bound_steps(ahead) steps after its deadline.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

from edgelite.config import SchedulerConfig


def _shares(users_per_tier: Counter[int], slots: int) -> dict[int, int]:
    """Running slots per user, for each tier with several users (fair shares are within a
    tier: between tiers, priority decides)."""
    return {t: max(1, slots // n) for t, n in users_per_tier.items() if n > 1}


@dataclass(eq=False)
class Request:
    rid: str
    tier: int
    prompt_len: int
    max_output: int
    arrival: float
    generated: int = 0
    preemptions: int = 0
    kv: int = 0  # KV tokens it needs (0 unless running)
    held: int = 0  # KV capacity charged for them (the node's bucket of `kv`)
    admitted_at: float | None = None  # first admission (for time to first token)
    queue: str = "new"
    overdue: bool = False  # waited past the patience threshold
    entered: bool = False  # (re)admitted this step: its next token's KV is already charged
    user: str = ""  # whose it is (fair shares of the running slots are per user)
    requeued: int = 0  # times it gave its slot to a user below its fair share

    @property
    def remaining(self) -> int:
        return self.max_output - self.generated

    @property
    def context(self) -> int:
        """Tokens whose KV a (re)prefill computes: the prompt plus what was generated."""
        return self.prompt_len + self.generated


@dataclass
class Decision:
    """What one step does; the caller runs it, then reports tokens with `advance`."""

    admit: list[Request] = field(default_factory=list)  # prefill the prompt
    resume: list[Request] = field(default_factory=list)  # re-prefill prompt + generated
    preempt: list[Request] = field(default_factory=list)  # drop their KV
    decode: list[Request] = field(default_factory=list)  # one token each
    paused: list[Request] = field(default_factory=list)  # running, KV kept, no token this step

    @property
    def idle(self) -> bool:
        return not (self.admit or self.resume or self.decode)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig | None = None) -> None:
        self.cfg = cfg or SchedulerConfig()
        self.fresh: list[tuple[float, int, Request]] = []  # key: -static priority
        self.overdue: list[tuple[float, int, Request]] = []  # key: -(static - slope * deadline)
        self.deadlines: list[tuple[float, int, Request]] = []  # fresh requests by deadline
        self.running: list[Request] = []
        self.preempted: list[tuple[float, int, Request]] = []  # key: -decode priority
        self.finished: deque[Request] = deque(maxlen=self.cfg.finished_window)  # the latest
        self.finished_count = 0
        self.kv_used = 0
        self.last_admit = -float("inf")
        self._seq = itertools.count()
        self.seen: dict[tuple[int, str], float] = {}  # (tier, user) -> when it last had work

    # ---- priority ------------------------------------------------------------------------
    def static_priority(self, r: Request) -> float:
        c, L = self.cfg, self.cfg.context_limit
        return (c.a_prompt * (L - r.prompt_len) / L + c.a_output * (L - r.max_output) / L
                + c.w_tier * r.tier)

    def decode_priority(self, r: Request) -> float:
        c, L = self.cfg, self.cfg.context_limit
        return c.a_decode * (L - r.remaining) / L + c.w_tier * r.tier

    def deadline(self, r: Request) -> float:
        """When r becomes overdue."""
        return r.arrival + self.cfg.patience_s * self.cfg.tier_patience_scale ** r.tier

    def priority(self, r: Request, now: float) -> float:
        """The full priority of a waiting request at `now` (for display and tests)."""
        return self.static_priority(r) + self.cfg.slope * max(0.0, now - self.deadline(r))

    # ---- queues --------------------------------------------------------------------------
    def submit(self, r: Request) -> None:
        if self.cap(r.prompt_len + r.max_output) > min(self.cfg.context_limit, self.cfg.kv_tokens):
            raise ValueError(f"the prompt's {r.prompt_len} tokens and max_tokens {r.max_output} "
                             f"exceed what this server holds for a request: a context of "
                             f"{self.cfg.context_limit} tokens, {self.cfg.kv_tokens} of KV memory")
        r.queue = "waiting"
        seq = next(self._seq)
        heapq.heappush(self.fresh, (-self.static_priority(r), seq, r))
        heapq.heappush(self.deadlines, (self.deadline(r), seq, r))

    def _promote(self, now: float) -> None:
        """Move requests past their patience deadline from the fresh to the overdue heap."""
        moved = False
        while self.deadlines and self.deadlines[0][0] <= now:
            deadline, seq, r = heapq.heappop(self.deadlines)
            if r.queue == "waiting" and not r.overdue:
                r.overdue = True
                key = -(self.static_priority(r) - self.cfg.slope * deadline)
                heapq.heappush(self.overdue, (key, seq, r))
                moved = True
        if moved:  # drop promoted entries from the fresh heap
            self.fresh = [e for e in self.fresh if not e[2].overdue]
            heapq.heapify(self.fresh)

    def waiting(self, now: float | None = None) -> list[Request]:
        """Waiting requests in priority order (as of `now` when given)."""
        if now is not None:
            self._promote(now)
        return [e[2] for e in sorted(self.overdue)] + [e[2] for e in sorted(self.fresh)]

    def preempted_list(self) -> list[Request]:
        return [e[2] for e in sorted(self.preempted)]

    # ---- one step ------------------------------------------------------------------------
    def decide(self, now: float) -> Decision:
        self._promote(now)
        d = Decision()
        if not self.preempted:
            if now - self.last_admit >= self.cfg.interval_s:
                self._admit(d, now)
            if d.admit:
                self.last_admit = now
                return d
            self._decode(d)
            return d
        self._decode(d)
        self._resume(d)
        return d

    def pinned(self, r: Request) -> bool:
        """At the preemption cap: never preempted again, so it holds KV for its whole output."""
        return r.preemptions >= self.cfg.max_preemptions

    def charge(self, r: Request) -> int:
        """KV tokens a (re)admission of r takes: its context, or all it can ever need if pinned
        (then decoding never asks for more, and no step can leave it stuck)."""
        return r.prompt_len + r.max_output if self.pinned(r) else r.context + 1

    def cap(self, tokens: int) -> int:
        """The KV capacity `tokens` occupy: the nodes hold KV in buckets (the smallest
        configured capacity that covers them); without buckets, the tokens themselves."""
        i = bisect.bisect_left(self.cfg.kv_buckets, tokens)
        return self.cfg.kv_buckets[i] if i < len(self.cfg.kv_buckets) else tokens

    def _shares(self, now: float) -> dict[int, int]:
        """Running slots per user while several users are active (None: no limit). A user is
        active with a request waiting, running or preempted, and for `fair_window_s` after one
        of its requests ran (so that users asking one thing after another keep their share)."""
        if not self.cfg.fair_share:
            return {}
        for r in self.running:
            self.seen[r.tier, r.user] = now
        for heap in (self.overdue, self.fresh, self.preempted):
            for e in heap:
                self.seen[e[2].tier, e[2].user] = now
        for k in [k for k, t in self.seen.items() if now - t > self.cfg.fair_window_s]:
            del self.seen[k]
        return _shares(Counter(tier for tier, _ in self.seen), self.cfg.max_requests)

    def _admit(self, d: Decision, now: float) -> None:
        tokens = 0
        shares = self._shares(now)
        per_user = Counter((r.tier, r.user) for r in self.running)
        passed: list[tuple[list, tuple[float, int, Request]]] = []  # over their share: put back
        try:
            for heap in (self.overdue, self.fresh):
                while heap:
                    r = heap[0][2]
                    share = shares.get(r.tier)
                    if share is not None and per_user[r.tier, r.user] >= share:
                        passed.append((heap, heapq.heappop(heap)))  # keeps its place
                        continue
                    if share is not None and len(self.running) >= self.cfg.max_requests:
                        victim = self._over_share(per_user, r.tier, share)
                        if victim is not None:
                            passed.append(self._requeue(victim))  # (not back before the end)
                            d.preempt.append(victim)
                            per_user[victim.tier, victim.user] -= 1
                    if len(self.running) >= self.cfg.max_requests:
                        return
                    fits = (tokens + self._step_tokens(r.prompt_len) <= self.cfg.max_step_tokens
                            and self.kv_used + self.cap(self.charge(r)) <= self.cfg.kv_tokens)
                    if not fits and r.overdue:
                        return  # nothing is admitted around an overdue head: it gets the room next
                    if not fits:  # (too large for now: smaller ones behind it go; it keeps its place)
                        passed.append((heap, heapq.heappop(heap)))
                        continue
                    heapq.heappop(heap)
                    tokens += self._step_tokens(r.prompt_len)
                    self._run(r)
                    per_user[r.tier, r.user] += 1
                    r.admitted_at = now
                    d.admit.append(r)
        finally:
            for heap, entry in passed:
                heapq.heappush(heap, entry)

    def _over_share(self, per_user: Counter[tuple[int, str]], tier: int, share: int
                    ) -> Request | None:
        """The lowest-priority running request (not admitted this step) of the user of `tier`
        furthest above its share, if any user of that tier is above it."""
        over = [k for k, n in per_user.items() if k[0] == tier and n > share]
        if not over:
            return None
        key = max(over, key=lambda k: per_user[k])
        cands = [r for r in self.running if (r.tier, r.user) == key and not r.entered]
        return min(cands, key=self.decode_priority) if cands else None

    def _requeue(self, r: Request) -> tuple[list, tuple[float, int, Request]]:
        """Back to waiting (fair share): its KV is dropped, its tokens are kept (the caller
        prefills prompt + generated on its next admission). Returns the heap and entry it
        goes back into (the caller pushes it once this step's admissions are done)."""
        self.running.remove(r)
        self.kv_used -= r.held
        r.kv, r.held, r.queue = 0, 0, "waiting"
        r.requeued += 1  # not a preemption: its user keeps its share, so it cannot starve
        seq = next(self._seq)
        if r.overdue:
            return self.overdue, (-(self.static_priority(r) - self.cfg.slope * self.deadline(r)), seq, r)
        heapq.heappush(self.deadlines, (self.deadline(r), seq, r))
        return self.fresh, (-self.static_priority(r), seq, r)

    def _run(self, r: Request) -> None:
        r.queue, r.kv, r.entered = "running", self.charge(r), True
        r.held = self.cap(r.kv)
        self.kv_used += r.held
        self.running.append(r)

    def _grow(self, r: Request) -> int:
        """Capacity one more token of r takes (0 within its bucket, and for pinned ones)."""
        return 0 if self.pinned(r) else self.cap(r.kv + 1) - r.held

    def _growth(self) -> int:
        return sum(self._grow(r) for r in self.running)

    def _decode(self, d: Decision) -> None:
        """Every running request gets one token; while the KV that takes does not fit, the
        lowest-priority running request below the cap is preempted (pinned ones never grow)."""
        while self.kv_used + self._growth() > self.cfg.kv_tokens:
            v = min((r for r in self.running if not self.pinned(r)), key=self.decode_priority)
            self._preempt(v)
            d.preempt.append(v)
        d.decode = sorted(self.running, key=self.decode_priority, reverse=True)
        if self.cfg.fair_share:
            users = {(r.tier, r.user) for r in d.decode}
            shares = _shares(Counter(tier for tier, _ in users), self.cfg.max_requests)
            taken: Counter[tuple[int, str]] = Counter()
            for r in d.decode:
                taken[r.tier, r.user] += 1
                if r.tier in shares and taken[r.tier, r.user] > shares[r.tier]:
                    d.paused.append(r)
            if d.paused:
                d.decode = [r for r in d.decode if r not in d.paused]

    def _preempt(self, r: Request, counted: bool = True) -> None:
        self.running.remove(r)
        self.kv_used -= r.held
        r.kv, r.held, r.queue = 0, 0, "preempted"
        r.preemptions += counted
        heapq.heappush(self.preempted, (-self.decode_priority(r), next(self._seq), r))

    def _step_tokens(self, prompt: int) -> int:
        """What a (re)prefill of `prompt` tokens costs one step's budget: a longer one is
        prefilled over several steps (the gateway sends a chunk per step), so it counts as
        the whole budget (it is admitted into an empty step)."""
        return min(prompt, self.cfg.max_step_tokens)

    def _resume(self, d: Decision) -> None:
        tokens = 0
        grow = sum(self._grow(r) for r in d.decode)
        while self.preempted:
            r = self.preempted[0][2]
            if (len(self.running) >= self.cfg.max_requests
                    or tokens + self._step_tokens(r.context) > self.cfg.max_step_tokens
                    or self.kv_used + grow + self.cap(self.charge(r)) > self.cfg.kv_tokens):
                return
            heapq.heappop(self.preempted)
            tokens += self._step_tokens(r.context)
            self._run(r)
            d.resume.append(r)

    def quiet_for(self, r: Request) -> bool:
        """r may decode a token before the next step: nothing waits, and its KV fits."""
        return (r.queue == "running" and not (self.fresh or self.overdue or self.preempted)
                and self.kv_used + self._grow(r) <= self.cfg.kv_tokens)

    # ---- results -------------------------------------------------------------------------
    def advance(self, r: Request, done: bool = False, keep_kv: bool = False) -> None:
        """One token was produced for r (by its prefill, resume or decode); `done` when it ended
        early (EOS). A finished request frees its KV at once, or, `keep_kv`, when `release`d
        (its KV is still held on the nodes while it is being stored)."""
        if r.queue != "running":
            raise ValueError(f"request {r.rid} is {r.queue}, not running")
        r.generated += 1
        if r.entered:  # this token's KV was charged when it was (re)admitted
            r.entered = False
        elif not self.pinned(r):
            r.kv += 1
            grown = self.cap(r.kv)
            self.kv_used += grown - r.held
            r.held = grown
        if done or r.remaining <= 0:
            self.running.remove(r)
            if not keep_kv:
                self.kv_used -= r.held
                r.held = 0
            r.kv, r.queue = 0, "finished"
            self.finished.append(r)
            self.finished_count += 1

    def release(self, r: Request) -> None:
        """A finished request's KV that `advance(keep_kv=True)` kept counted is free now."""
        if r.queue == "finished":
            self.kv_used -= r.held
            r.held = 0

    def cancel(self, r: Request) -> None:
        """Drop a request wherever it is (its client went away); its KV is freed at once."""
        if r.queue == "running":
            self.running.remove(r)
            self.kv_used -= r.held
        elif r.queue == "waiting":
            self.fresh, self.overdue, self.deadlines = (
                _without(h, r) for h in (self.fresh, self.overdue, self.deadlines))
        elif r.queue == "preempted":
            self.preempted = _without(self.preempted, r)
        else:
            return
        r.kv, r.held, r.queue = 0, 0, "cancelled"

    def lost_kv(self) -> list[Request]:
        """The nodes lost every session's KV (a node restarted): each running request goes to
        the preempted queue, to be recomputed from prompt + generated tokens on resume. Not
        counted as a preemption. Returns them."""
        lost = list(self.running)
        for r in lost:
            self._preempt(r, counted=False)
        return lost

    def wait_bound_steps(self, ahead: int, max_output: int) -> int:
        """Steps after its patience deadline within which a request with `ahead` requests in
        front of it (see the module docstring) is admitted; max_output: the largest any of
        them asked for."""
        return (ahead + 1) * (1 + max_output) * (1 + self.cfg.max_preemptions)


def _without(heap: list[tuple[float, int, Request]], r: Request) -> list[tuple[float, int, Request]]:
    """A queue's heap less r's entry (a heap again)."""
    rest = [e for e in heap if e[2] is not r]
    heapq.heapify(rest)
    return rest
