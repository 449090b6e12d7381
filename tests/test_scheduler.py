"""The three-queue scheduler, driven by hypothesis through random arrivals, steps and EOS."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from edgelite.config import SchedulerConfig
from edgelite.serve.scheduler import Request, Scheduler

pytestmark = pytest.mark.unit

CFG = SchedulerConfig(context_limit=512, patience_s=1.0, max_requests=4, max_step_tokens=300,
                      kv_tokens=600, max_preemptions=2)


class SchedulerMachine(RuleBasedStateMachine):
    cfg = CFG

    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(self.cfg)
        self.now = 0.0
        self.steps = 0
        self.all: list[Request] = []
        self.ids = itertools.count()
        self.overdue_step: dict[str, tuple[int, int]] = {}  # rid -> (step it was late, ahead)

    @rule(tier=st.integers(0, 2), prompt=st.integers(1, 250), out=st.integers(1, 120))
    def submit(self, tier: int, prompt: int, out: int) -> None:
        r = Request(f"r{next(self.ids)}", tier, prompt, out, self.now)
        self.s.submit(r)
        self.all.append(r)

    @rule(dt=st.sampled_from([0.05, 0.2, 0.5]), data=st.data())
    def step(self, dt: float, data: st.DataObject) -> None:
        self.now += dt
        self.steps += 1
        order = self.s.waiting(self.now)
        d = self.s.decide(self.now)
        # admission is in priority order (a subsequence of the waiting order), and nothing is
        # admitted around an overdue request left waiting
        at = [next(i for i, w in enumerate(order) if w is r) for r in d.admit]
        assert at == sorted(at)
        skipped = [w for w in order[:max(at, default=-1) + 1] if w not in d.admit]
        assert not any(w.overdue for w in skipped), [w.rid for w in skipped]
        assert sum(r.prompt_len for r in d.admit) <= self.cfg.max_step_tokens
        assert sum(r.context for r in d.resume) <= self.cfg.max_step_tokens
        assert len(self.s.running) <= self.cfg.max_requests
        assert not (d.admit and d.decode)  # a step prefills or decodes
        for r in d.admit + d.resume + d.decode:
            eos = data.draw(st.integers(0, 19)) == 0
            self.s.advance(r, done=eos)
        for r in self.s.waiting():
            if r.overdue and r.rid not in self.overdue_step:
                ahead = len(self.s.running) + len(self.s.preempted) + sum(
                    1 for w in self.s.waiting() if w.overdue and w is not r)
                self.overdue_step[r.rid] = (self.steps, ahead)
        for r in d.admit:
            if r.rid in self.overdue_step:
                late_at, ahead = self.overdue_step[r.rid]
                bound = self.s.wait_bound_steps(ahead, max(q.max_output for q in self.all))
                assert self.steps - late_at <= bound
                event(f"overdue request admitted, waited {min(self.steps - late_at, 5)}+ steps")

    @invariant()
    def each_request_in_exactly_one_queue(self) -> None:
        queues = {"waiting": self.s.waiting(), "running": self.s.running,
                  "preempted": self.s.preempted_list(), "finished": list(self.s.finished)}
        for r in self.all:
            homes = [name for name, q in queues.items() if any(x is r for x in q)]
            assert homes == [r.queue], (r.rid, homes, r.queue)

    @invariant()
    def kv_budget_holds_and_finished_requests_hold_none(self) -> None:
        assert self.s.kv_used == sum(r.held for r in self.s.running)
        assert all(r.held == self.s.cap(r.kv) >= r.kv for r in self.s.running)
        assert self.s.kv_used <= self.cfg.kv_tokens
        assert all(r.kv == r.held == 0 for r in list(self.s.finished) + self.s.preempted_list())

    @invariant()
    def preemption_cap_holds(self) -> None:
        assert all(r.preemptions <= self.cfg.max_preemptions for r in self.all)


class BucketedSchedulerMachine(SchedulerMachine):
    """The same, with KV counted in capacity buckets as the nodes hold it."""

    cfg = SchedulerConfig(context_limit=512, patience_s=1.0, max_requests=4, max_step_tokens=300,
                          kv_tokens=1200, max_preemptions=2, kv_buckets=(64, 128, 256, 512))


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestBucketedScheduler = BucketedSchedulerMachine.TestCase
TestBucketedScheduler.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)


def test_equal_waits_higher_tier_first() -> None:
    s = Scheduler(CFG)
    low, high = Request("low", 0, 50, 50, 0.0), Request("high", 2, 50, 50, 0.0)
    s.submit(low)
    s.submit(high)
    assert s.waiting() == [high, low]
    assert s.decide(0.1).admit[0] is high


def test_overdue_request_outranks_any_new_arrival() -> None:
    s = Scheduler(CFG)
    old = Request("old", 0, 250, 100, 0.0)  # low tier, long: the lowest static priority
    s.submit(old)
    s.submit(Request("fill", 2, 250, 100, 0.0))
    s.decide(0.0)  # admits fill, then old does not fit the step's token budget
    new = Request("new", 2, 10, 10, 1.5)  # high tier, short: the highest static priority
    s.submit(new)
    assert s.priority(new, 1.5) > s.priority(old, 0.5)  # before old is overdue
    assert s.priority(old, 1.5) > s.priority(new, 1.5)  # after: the wait term dominates
    assert s.waiting() == [new, old]
    assert s.waiting(1.5) == [old, new]  # promoted at its deadline
    assert s.decide(1.5).admit[0] is old


def test_decode_preempts_lowest_priority_and_resume_recomputes() -> None:
    s = Scheduler(SchedulerConfig(context_limit=512, kv_tokens=120, max_step_tokens=300,
                                  max_requests=4, max_preemptions=1))
    a, b = Request("a", 2, 50, 60, 0.0), Request("b", 0, 50, 60, 0.0)
    s.submit(a)
    s.submit(b)
    d = s.decide(0.0)
    assert d.admit == [a, b]
    for r in d.admit:
        s.advance(r)
    preempted = []
    for t in range(1, 40):
        d = s.decide(t * 0.1)
        preempted += d.preempt
        for r in d.resume + d.decode:
            s.advance(r)
    assert preempted and preempted[0] is b  # the low tier goes first
    assert b.preemptions == 1 and s.pinned(b)


def test_one_user_cannot_hold_every_slot_while_others_wait() -> None:
    """Fair shares: a user running every slot gives one up to a newcomer at once; while the
    newcomer waits, the first user's own queue is passed over; alone, it used every slot."""
    cfg = SchedulerConfig(context_limit=512, max_requests=4, kv_tokens=10_000, max_preemptions=3)
    s = Scheduler(cfg)
    hog = [Request(f"h{i}", 0, 10, 100, 0.0, user="hog") for i in range(6)]
    for r in hog:
        s.submit(r)
    d = s.decide(0.1)
    assert len(d.admit) == 4  # alone: all four slots
    for r in d.admit:
        s.advance(r)
    s.submit(Request("n", 0, 10, 10, 0.2, user="new"))
    d = s.decide(0.3)
    assert [r.rid for r in d.admit] == ["n"] and len(d.preempt) == 1
    victim = d.preempt[0]
    s.advance(d.admit[0])
    held = {r.rid: r.held for r in s.running}
    d2 = s.decide(0.35)  # 3 hog requests and 1 new one decode: hog decodes its share (2) only
    assert sorted(r.user for r in d2.decode) == ["hog", "hog", "new"]
    assert [r.user for r in d2.paused] == ["hog"] and d2.paused[0].queue == "running"
    assert d2.paused[0].held == held[d2.paused[0].rid]  # paused: its KV is kept
    for r in d2.decode:
        s.advance(r)
    assert victim.user == "hog" and victim.queue == "waiting" and victim.generated == 1
    assert victim.requeued == 1 and victim.preemptions == 0
    assert sum(r.user == "hog" for r in s.running) == 3
    s.submit(Request("n2", 0, 10, 10, 0.4, user="new"))
    d = s.decide(0.5)  # hog is above its share (2): n2 takes one of its slots, not a hog request
    assert [r.rid for r in d.admit] == ["n2"]
    assert sum(r.user == "hog" for r in s.running) == 2
    assert all(r.user == "hog" for r in s.waiting())


def test_a_finished_requests_kv_stays_counted_until_it_is_released() -> None:
    """While a finished request's KV is being stored (the gateway's `finishing`), the nodes
    still hold it: with `keep_kv` nothing is admitted into it until `release`."""
    s = Scheduler(SchedulerConfig(context_limit=512, patience_s=1.0, max_requests=4,
                                  max_step_tokens=600, kv_tokens=300, max_preemptions=2))
    a = Request("a", 0, 200, 1, 0.0)
    s.submit(a)
    assert s.decide(0.0).admit == [a]
    s.advance(a, done=True, keep_kv=True)
    assert a.queue == "finished" and s.kv_used == a.held > 0
    b = Request("b", 0, 200, 1, 0.1)
    s.submit(b)
    assert s.decide(0.1).admit == []  # b's 200 tokens do not fit beside a's
    s.release(a)
    assert s.kv_used == 0 and s.decide(0.2).admit == [b]
    s.release(b)  # (not finished: nothing to release)
    assert s.kv_used == b.held > 0


def test_a_long_prompt_delays_nobody_and_is_not_passed_forever() -> None:
    """Issue 65: with the gateway's defaults (8,192 KV tokens, the nodes' buckets), a 5,200-token
    prompt is charged 6,144 (was a whole 8,192 bucket, and nothing else was admitted until it
    finished); a short request arriving the step after it is admitted at the next step. One that
    does not fit yet keeps its place while short ones go around it, until its deadline: then
    nothing is admitted around it and it gets the room as the running ones finish."""
    from edgelite.config import RuntimeConfig

    buckets = RuntimeConfig().kv_buckets
    cfg = SchedulerConfig(context_limit=8192, kv_tokens=8192, kv_buckets=buckets, patience_s=5.0)
    s = Scheduler(cfg)
    big = Request("big", 0, 5200, 256, 0.0, user="a")
    s.submit(big)
    assert s.decide(0.0).admit == [big] and big.held == 6144
    s.advance(big)
    small = Request("small", 0, 30, 64, 0.1, user="b")
    s.submit(small)
    assert s.decide(0.2).admit == [small]  # the next step
    s.advance(small)
    # a second long prompt does not fit beside the first: short ones go around it ...
    big2 = Request("big2", 0, 5200, 256, 0.3, user="c")
    s.submit(big2)
    shorts = [Request(f"s{i}", 0, 30, 8, 0.3 + i * 0.5, user=f"u{i}") for i in range(12)]
    now, admitted = 0.3, []
    for r in shorts:
        s.submit(r)
        now = r.arrival + 0.1
        d = s.decide(now)
        admitted += d.admit
        for x in d.admit + d.decode:
            s.advance(x)
        if big2.overdue:
            break
    assert big2 not in admitted and admitted and big2.overdue
    # ... until it is overdue: then it waits for room, and nothing passes it
    s.submit(late := Request("late", 0, 30, 8, now, user="d"))
    for _ in range(400):
        now += 0.1
        d = s.decide(now)
        assert late not in d.admit or big2.queue != "waiting"
        for x in d.admit + d.decode:
            s.advance(x)
        if big2.queue != "waiting":
            break
    assert big2.queue == "running" and big2.held == 6144
