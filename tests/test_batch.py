"""Decode steps of several sessions that reach a node together run as one batch (their KV in
place in one slab), on a real node process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgelite import manifest as mf
from edgelite.cli.localnodes import NodeProc
from edgelite.client.backend import ClusterBackend
from edgelite.config import RuntimeConfig
from edgelite.engine.layers import LayerRange, export_files
from edgelite.engine.runtime import ClientPart
from edgelite.ids import NodeAddr
from edgelite.net import messages as msgs
from edgelite.net.frames import pack
from test_distributed import _cluster
from test_node_bad_input import _authed, _data

pytestmark = pytest.mark.e2e


@contextlib.asynccontextmanager
async def _one_node(model: Path, node: NodeProc) -> AsyncIterator[tuple[ClusterBackend, Any, Any]]:
    """A plan of every layer on one node, whose steps the test sends on a data connection of
    its own and whose results it reads on the plan's sink (taken over from the plan's client)."""
    be = await _cluster(model, [node.addr], [(0, mf.load(model).num_layers - 1)])
    plan = be.cluster.plan_id
    cap = be.cluster.capabilities[NodeAddr.parse(node.addr)]
    try:
        sink = await _authed(node.port)
        await sink.send(msgs.OpenData(id=1, plan_id=plan, role="sink", capability=cap))
        assert isinstance(await sink.recv(), msgs.DataReady)
        steps_in = await _data(node.port, plan, cap)
        yield be, sink, steps_in
        await sink.close()
        await steps_in.close()
    finally:
        await be.close()


def _llama_on_a_node(exported, node_factory, seed: int) -> tuple[
        Path, mf.Manifest, NodeProc, LayerRange, np.random.Generator]:
    """The tiny Llama, a node, its layers in this process (to run steps alone) and a
    random generator."""
    model = exported["llama"]
    m = mf.load(model)
    # (batches: only where rows need not be invariant, engine/passes/invariant.py)
    return (model, m, node_factory(extra=("--no-invariant",)),
            LayerRange(m, 0, m.num_layers - 1, RuntimeConfig(threads=1, invariant=False),
                       export_files(m)), np.random.default_rng(seed))


def _solo(layers: LayerRange, prompt: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Prefill then one decode step on its own: the decode step's output."""
    slot = layers.pool.acquire()
    layers.run(slot, prompt)
    out = layers.run(slot, step)
    layers.pool.release(slot)
    return out


def test_client_head_runs_several_sessions_at_once(exported) -> None:
    """The client's head over several sessions' results (of different lengths) in one run
    gives each the logits of its own last position, as a run of its own does."""
    for kind in ("llama", "qwen2"):
        m = mf.load(exported[kind])
        part = ClientPart(m, RuntimeConfig(threads=1))
        rng = np.random.default_rng(5)
        hiddens = [rng.standard_normal((1, n, m.hidden_size)).astype(np.float32) for n in (3, 1, 2)]
        batched = part.heads(hiddens)
        assert batched.shape == (3, m.vocab_size)
        for h, row in zip(hiddens, batched, strict=True):
            np.testing.assert_allclose(row, part.head(h), atol=1e-5, rtol=0)
        np.testing.assert_array_equal(part.heads(hiddens[:1])[0], part.head(hiddens[0]))


def _frame(plan: str, session: str, step: int, start: int, hidden: np.ndarray) -> bytes:
    return pack(msgs.Forward(plan_id=plan, session=session, step=step, start=start, hidden=hidden))


def test_node_batches_steps_that_arrive_together(exported, node_factory) -> None:
    model, m, node, layers, rng = _llama_on_a_node(exported, node_factory, 2)
    lengths = [2, 6, 4, 1]
    prompts = [rng.standard_normal((1, n, m.hidden_size)).astype(np.float32) for n in lengths]
    steps = [rng.standard_normal((1, 1, m.hidden_size)).astype(np.float32) for _ in lengths]

    async def main() -> None:
        async with _one_node(model, node) as (be, sink, steps_in):
            plan = be.cluster.plan_id
            for i, p in enumerate(prompts):  # prefill each session on its own
                await steps_in.send(msgs.Forward(plan_id=plan, session=f"s{i}", step=0, start=0,
                                              hidden=p))
                assert (await asyncio.wait_for(sink.recv(), 10)).error is None
            # all decode steps in one write, so they are read in one go; plus one with a
            # wrong start, which is refused on its own while the others run batched: 4 steps
            # (wave_split_min) as two halves of neighbouring KV slots (s0 s1, then s2 s3,
            # whatever order they came in), the first half passed on before the second runs
            order = [2, 0, 3, 1]
            burst = b"".join(_frame(plan, f"s{i}", 1, lengths[i], steps[i]) for i in order)
            steps_in.writer.write(burst + _frame(plan, "s0", 1, 99, steps[0]))
            await steps_in.writer.drain()
            got = {}
            for _ in range(len(lengths) + 1):
                msg = await asyncio.wait_for(sink.recv(), 10)
                got[(msg.session, msg.start)] = msg
            refused = [msg for msg in got.values() if msg.error is not None]
            assert len(refused) == 1 and "starts at 99" in refused[0].error
            done = [key[0] for key, msg in got.items() if msg.error is None]  # in arrival order
            assert {*done[:2]} == {"s0", "s1"} and {*done[2:]} == {"s2", "s3"}, list(got)
            for i, (p, s) in enumerate(zip(prompts, steps, strict=True)):
                out = got[(f"s{i}", lengths[i])].hidden
                np.testing.assert_allclose(out, _solo(layers, p, s), atol=1e-5, rtol=0)
            stats = (await be.cluster.stats())[be.plan.stages[0].addr]
            assert stats["batches"] == 2 and stats["batched_steps"] == len(lengths), stats
            # a prompt's chunk and its one-token last chunk arrive between two sessions'
            # decode steps: the one-token step waits for its prompt, it does not join the batch
            prompt_p = rng.standard_normal((1, 3, m.hidden_size)).astype(np.float32)
            step_p = rng.standard_normal((1, 1, m.hidden_size)).astype(np.float32)
            steps_in.writer.write(_frame(plan, "s0", 2, lengths[0] + 1, steps[0])
                                  + _frame(plan, "p", 0, 0, prompt_p) + _frame(plan, "p", 1, 3, step_p)
                                  + _frame(plan, "s1", 2, lengths[1] + 1, steps[1]))
            await steps_in.writer.drain()
            got = {}
            for _ in range(4):
                msg = await asyncio.wait_for(sink.recv(), 10)
                got[(msg.session, msg.start)] = msg
            assert all(msg.error is None for msg in got.values()), [g.error for g in got.values()]
            np.testing.assert_allclose(got[("p", 3)].hidden, _solo(layers, prompt_p, step_p),
                                       atol=1e-5, rtol=0)

    asyncio.run(main())


def test_a_batch_splits_into_two_waves_once_and_a_wave_stays_whole(exported, node_factory) -> None:
    """8 sessions' decode steps arriving together run as two waves of 4 (not 4, 2 and 2), and
    4 of the 8 arriving alone (a wave, as the next stage sees it) run as one batch: a node
    splits only a batch of more than half of its plan's sessions, and only once."""
    model, m, node, _, rng = _llama_on_a_node(exported, node_factory, 3)
    hidden = [rng.standard_normal((1, 2, m.hidden_size)).astype(np.float32) for _ in range(8)]

    async def main() -> None:
        async with _one_node(model, node) as (be, sink, steps_in):
            plan, addr = be.cluster.plan_id, be.plan.stages[0].addr
            for i, p in enumerate(hidden):
                await steps_in.send(msgs.Forward(plan_id=plan, session=f"s{i}", step=0, start=0, hidden=p))
                assert (await asyncio.wait_for(sink.recv(), 10)).error is None
            for sessions, start, batches in ((range(8), 2, [4, 4]), (range(4), 3, [4])):
                before = (await be.cluster.stats())[addr]
                steps_in.writer.write(b"".join(_frame(plan, f"s{i}", 1, start, hidden[i][:, :1])
                                               for i in sessions))
                await steps_in.writer.drain()
                for _ in sessions:
                    assert (await asyncio.wait_for(sink.recv(), 10)).error is None
                after = (await be.cluster.stats())[addr]
                ran = (after["batches"] - before["batches"], after["batched_steps"] - before["batched_steps"])
                assert ran == (len(batches), sum(batches)), (after, before)

    asyncio.run(main())


def _state(pid: int) -> str:
    """A process's state letter (/proc: R running, S sleeping, T stopped, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@contextlib.asynccontextmanager
async def _stopped(node: NodeProc) -> AsyncIterator[None]:
    """The node stopped (SIGSTOP, waited for) while the body writes, continued once the writes
    are in its sockets: it reads them all in one round."""
    node.stop()
    try:
        for _ in range(1000):
            if _state(node.proc.pid) == "T":
                break
            await asyncio.sleep(0.001)
        yield
        await asyncio.sleep(0.05)  # (loopback: the writes are in the node's sockets)
    finally:
        node.cont()


def test_two_clients_plans_on_the_same_layers_batch_together(exported, node_factory) -> None:
    """Decode steps of two plans (two clients) of one model's layers on a node run as one
    batch, each result on its own plan's connection, each as it is alone. (The node is
    stopped while both write, so that it reads both in one round.)"""
    model, m, node, layers, rng = _llama_on_a_node(exported, node_factory, 4)
    prompts = [rng.standard_normal((1, 2, m.hidden_size)).astype(np.float32) for _ in range(3)]
    steps = [rng.standard_normal((1, 1, m.hidden_size)).astype(np.float32) for _ in range(3)]

    async def main() -> None:
        async with _one_node(model, node) as (be_a, sink_a, in_a), \
                _one_node(model, node) as (be_b, sink_b, in_b):
            mine = [(be_a, sink_a, in_a, "a0"), (be_a, sink_a, in_a, "a1"), (be_b, sink_b, in_b, "b0")]
            for (be, sink, steps_in, session), p in zip(mine, prompts, strict=True):
                await steps_in.send(msgs.Forward(plan_id=be.cluster.plan_id, session=session, step=0,
                                                 start=0, hidden=p))
                assert (await asyncio.wait_for(sink.recv(), 10)).error is None
            addr = be_a.plan.stages[0].addr
            before = (await be_a.cluster.stats())[addr]
            async with _stopped(node):
                for (be, _, steps_in, session), s in zip(mine, steps, strict=True):
                    steps_in.writer.write(_frame(be.cluster.plan_id, session, 1, 2, s))
                await asyncio.gather(in_a.writer.drain(), in_b.writer.drain())
            got = {}
            for sink in (sink_a, sink_a, sink_b):
                msg = await asyncio.wait_for(sink.recv(), 10)
                assert msg.error is None, msg.error
                got[(msg.plan_id, msg.session)] = msg.hidden
            for (be, _, _, session), p, s in zip(mine, prompts, steps, strict=True):
                np.testing.assert_allclose(got[(be.cluster.plan_id, session)], _solo(layers, p, s),
                                           atol=1e-5, rtol=0)
            after = (await be_a.cluster.stats())[addr]
            assert [s["batched_decode"] for s in after["stages"]] == [True]  # (its own plan's)
            # the other client's session at the end of its positions: refused alone (before it
            # joins a batch), and this client's steps in the same round still answered
            full = rng.standard_normal((1, layers.pool.max_length - 3, m.hidden_size)).astype(np.float32)
            await in_b.send(msgs.Forward(plan_id=be_b.cluster.plan_id, session="b0", step=2, start=3,
                                         hidden=full))
            assert (await asyncio.wait_for(sink_b.recv(), 10)).error is None
            async with _stopped(node):
                for session in ("a0", "a1"):
                    in_a.writer.write(_frame(be_a.cluster.plan_id, session, 2, 3, steps[0]))
                in_b.writer.write(_frame(be_b.cluster.plan_id, "b0", 3, layers.pool.max_length, steps[0]))
                await asyncio.gather(in_a.writer.drain(), in_b.writer.drain())
            assert [(await asyncio.wait_for(sink_a.recv(), 10)).error for _ in range(2)] == [None, None]
            refused = (await asyncio.wait_for(sink_b.recv(), 10)).error
            assert refused is not None and "positions" in refused, refused
            assert (after["batches"] - before["batches"], after["batched_steps"] - before["batched_steps"]) \
                == (1, 3), ({k: (before[k], after[k]) for k in ("batches", "batched_steps", "lane_steps")})

    asyncio.run(main())


def test_a_lone_decode_step_takes_the_lane_as_the_general_path_would(exported, node_factory) -> None:
    """A decode step that is the only input of a wait runs from its frame's bytes (the node's
    decode lane): the same output and trace as the general path, on a real node; a lone step
    the general path would refuse, or treat specially, is left to it and gets its answer."""
    model, m, node, layers, rng = _llama_on_a_node(exported, node_factory, 4)
    prompt = rng.standard_normal((1, 5, m.hidden_size)).astype(np.float32)
    steps = [rng.standard_normal((1, 1, m.hidden_size)).astype(np.float32) for _ in range(4)]
    slot = layers.pool.acquire()
    layers.run(slot, prompt)
    want = [layers.run(slot, s) for s in steps]

    async def main() -> None:
        async with _one_node(model, node) as (be, sink, steps_in):
            plan, addr = be.cluster.plan_id, be.plan.stages[0].addr

            async def one(frame: bytes) -> msgs.Result:
                steps_in.writer.write(frame)
                await steps_in.writer.drain()
                return await asyncio.wait_for(sink.recv(), 10)

            assert (await one(_frame(plan, "s", 0, 0, prompt))).error is None  # a new session
            lane0 = (await be.cluster.stats())[addr]["lane_steps"]
            for i, s in enumerate(steps[:2]):
                got = await one(pack(msgs.Forward(plan_id=plan, session="s", step=1 + i, start=5 + i,
                                                  hidden=s, trace=[(7, 9)])))
                assert got.error is None and got.step == 1 + i and got.start == 5 + i
                np.testing.assert_allclose(got.hidden, want[i], atol=1e-5, rtol=0)
                assert len(got.trace) == 2 and got.trace[0] == (7, 9)
                assert 0 < got.trace[1][0] <= got.trace[1][1]  # compute within held, in us
            assert (await be.cluster.stats())[addr]["lane_steps"] == lane0 + 2
            # refused by the general path, each with its reason: a wrong start, a session this
            # node does not hold, a wrong width (on the sender's connection: the step does not
            # fit the stage); the session goes on after them
            assert "starts at 99" in (await one(_frame(plan, "s", 3, 99, steps[2]))).error
            wide = rng.standard_normal((1, 1, m.hidden_size + 4)).astype(np.float32)
            steps_in.writer.write(_frame(plan, "s", 3, 7, wide))
            assert "expected float32" in (await asyncio.wait_for(steps_in.recv(), 10)).error
            assert "holds KV for 0 tokens" in (await one(_frame(plan, "x", 3, 7, steps[2]))).error
            assert (await be.cluster.stats())[addr]["lane_steps"] == lane0 + 2
            for i, s in enumerate(steps[2:], start=2):
                got = await one(_frame(plan, "s", 1 + i, 5 + i, s))
                assert got.error is None
                np.testing.assert_allclose(got.hidden, want[i], atol=1e-5, rtol=0)
            assert (await be.cluster.stats())[addr]["lane_steps"] == lane0 + 4

    asyncio.run(main())


def test_a_batchs_sessions_are_moved_next_to_each_other_with_their_kv(exported, node_factory) -> None:
    """A batch runs over the span of its sessions' KV slots: a node moves the sessions of a
    batch with a gap between them next to each other once (the session in the way takes the
    place left), and every session's outputs stay those of running alone."""
    model, m, node, layers, rng = _llama_on_a_node(exported, node_factory, 6)
    lengths = [3, 5, 2, 4]
    prompts = [rng.standard_normal((1, n, m.hidden_size)).astype(np.float32) for n in lengths]
    mine = [layers.pool.acquire() for _ in lengths]  # the same steps run alone, here
    for slot, p in zip(mine, prompts, strict=True):
        layers.run(slot, p)

    async def main() -> None:
        async with _one_node(model, node) as (be, sink, steps_in):
            plan, addr = be.cluster.plan_id, be.plan.stages[0].addr
            for i, p in enumerate(prompts):  # slots 0-3, in this order
                await steps_in.send(msgs.Forward(plan_id=plan, session=f"s{i}", step=0, start=0,
                                                 hidden=p))
                assert (await asyncio.wait_for(sink.recv(), 10)).error is None
            position = list(lengths)

            async def burst(sessions: list[int]) -> None:
                steps = {i: rng.standard_normal((1, 1, m.hidden_size)).astype(np.float32)
                         for i in sessions}
                steps_in.writer.write(b"".join(_frame(plan, f"s{i}", 1 + position[i] - lengths[i],
                                                      position[i], s) for i, s in steps.items()))
                await steps_in.writer.drain()
                for _ in sessions:
                    got = await asyncio.wait_for(sink.recv(), 10)
                    i = int(got.session[1:])
                    assert got.error is None and got.start == position[i], got.error
                    np.testing.assert_allclose(got.hidden, layers.run(mine[i], steps[i]),
                                               atol=1e-5, rtol=0)
                for i in sessions:
                    position[i] += 1

            stats = (await be.cluster.stats())[addr]
            assert stats["slot_moves"] == 0 and stats["batches"] == 0
            await burst([0, 2])  # slots 0 and 2: s2 moves to slot 1, s1 to slot 2
            await burst([1, 3])  # now slots 2 and 3: together already
            await burst([2, 0])
            await burst([3, 1])
            stats = (await be.cluster.stats())[addr]
            assert stats["slot_moves"] == 1 and stats["batches"] == 4, stats

    asyncio.run(main())
