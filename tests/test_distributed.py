"""Generation across real node processes on 127.0.0.1 (tiny models)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite import manifest as mf
from edgelite.cli.localnodes import TOKEN
from edgelite.client.backend import ClusterBackend, open_backend
from edgelite.client.local import LocalBackend
from edgelite.config import ClientConfig, GenerationConfig, RuntimeConfig
from edgelite.errors import NodeUnavailable
from edgelite.ids import NodeAddr
from edgelite.net.steptrace import hop_summary
from edgelite.planner.solve import split_plan
from edgelite.reply.generate import generate

pytestmark = pytest.mark.e2e


def gen_cli(model: Path, *extra: str, prompt: str = "hello world") -> dict:
    res = run_cli("generate", "--model", str(model), "--max-tokens", "20", "--json", *extra, prompt,
                  timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_split_generation_equals_local(exported, node_factory, arch: str) -> None:
    model = exported[arch]
    n_layers = mf.load(model).num_layers
    nodes = [node_factory() for _ in range(2)]
    split = f"0-0,1-{n_layers - 1}"
    local = gen_cli(model)
    remote = gen_cli(model, "--nodes", ",".join(n.addr for n in nodes), "--split", split,
                     "--token", TOKEN)
    assert remote["token_ids"] == local["token_ids"]
    assert remote["text"] == local["text"]


async def _cluster(model: Path, addrs: list[str], split: list[tuple[int, int]],
                   cfg: ClientConfig | None = None) -> ClusterBackend:
    m = mf.load(model)
    plan = split_plan(split, [NodeAddr.parse(a) for a in addrs], m.num_layers)
    backend = await open_backend(m, plan, TOKEN, cfg, RuntimeConfig(threads=1))
    assert isinstance(backend, ClusterBackend)
    return backend


async def _tokens(backend, prompt: list[int], n: int = 12, session: str | None = None) -> list[int]:
    return [p.token_id async for p in generate(backend, prompt, GenerationConfig(max_tokens=n),
                                               session=session) if p.token_id is not None]


def test_concurrent_sessions_interleave_and_free_kv(exported, node_factory) -> None:
    model = exported["llama"]
    nodes = [node_factory(), node_factory()]

    async def main() -> None:
        local = LocalBackend(mf.load(model))
        prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
        want = [await _tokens(local, p) for p in prompts]
        be = await _cluster(model, [n.addr for n in nodes], [(0, 0), (1, 2)])
        try:
            got = await asyncio.gather(*(_tokens(be, p) for p in prompts))
            assert list(got) == want
            stats = list((await be.cluster.stats()).values())
            assert all(s["sessions"] == 0 and s["kv_bytes"] == 0 for s in stats), stats
            assert all(s["runs"] - s["batches"] + s["batched_steps"] >= 4 * 12 for s in stats)
            traces = list(be.traces)  # every step says where its time went, per stage
            assert len(traces) == 4 * 12 and all(len(t.stages) == 2 for t in traces)
            assert all(0 <= c <= h < t.rtt_us for t in traces for c, h in t.stages)
            assert 0 < hop_summary(traces)["hop_us"] < 20_000
            # every token's logits came from the client's head; results that came in together
            # (the last node sends a batch's results in one write) shared one run of it
            assert be.plane.head_rows == 4 * 12
            assert be.plane.head_runs < be.plane.head_rows, (be.plane.head_runs, be.plane.head_rows)
        finally:
            await be.close()

    asyncio.run(main())


def test_deploy_skips_files_already_there(exported, node_factory) -> None:
    model = exported["llama"]
    node = node_factory()

    async def main() -> None:
        for _ in range(2):
            be = await _cluster(model, [node.addr], [(0, 2)])
            await be.close()

    asyncio.run(main())
    blobs = sorted(p.name for p in (node.data_dir / "blobs").iterdir())
    m = mf.load(model)
    assert blobs == sorted(s for e in m.layers for s in (e.sha256, *(d.sha256 for d in e.data)))


def test_dead_node_named_quickly_and_other_cluster_goes_on(exported, node_factory) -> None:
    model = exported["llama"]
    a, b, c = node_factory(), node_factory(), node_factory()

    async def main() -> None:
        victim = await _cluster(model, [a.addr, b.addr], [(0, 0), (1, 2)])
        healthy = await _cluster(model, [c.addr], [(0, 2)])
        try:
            await _tokens(victim, [5, 6], 2, session="v1")
            b.kill()
            t0 = time.monotonic()
            with pytest.raises(NodeUnavailable, match=str(b.port)):
                await _tokens(victim, [5, 6], 4, session="v2")
            assert time.monotonic() - t0 <= 2.5
            assert len(await _tokens(healthy, [5, 6, 7], 6)) > 0
        finally:
            await victim.close()
            await healthy.close()

    asyncio.run(main())


def test_stalled_node_named_within_timeout(exported, node_factory) -> None:
    model = exported["llama"]
    a, b = node_factory(), node_factory()

    async def main() -> None:
        be = await _cluster(model, [a.addr, b.addr], [(0, 1), (2, 2)],
                            ClientConfig(step_timeout_s=1.0))
        try:
            await _tokens(be, [5, 6], 2, session="s1")
            b.stop()
            t0 = time.monotonic()
            with pytest.raises(NodeUnavailable, match=f"{b.port}.*(stalled|no heartbeat)"):
                await _tokens(be, [5], 3, session="s1b")
            assert time.monotonic() - t0 <= 2.5
        finally:
            b.cont()
            await be.close()

    asyncio.run(main())


def test_a_node_refuses_a_load_beyond_its_memory_budget(exported, node_factory, tmp_path) -> None:
    """--memory-mb bounds the node process: a load whose layers (what they hold once loaded,
    as the manifest says) would take it over is refused with one line naming the budget and
    the figures; the same node takes a range that fits, and its RSS stays within the budget."""
    import dataclasses
    import shutil

    model = tmp_path / "big"
    shutil.copytree(exported["llama"], model)
    m = mf.load(model)
    big = [dataclasses.replace(e, resident_bytes=72 << 20, narrow_resident_bytes=0) for e in m.layers]
    mf.write(dataclasses.replace(m, layers=big, range_bytes=0, narrow_range_bytes=0), model)
    node, other = node_factory(memory_mb=200), node_factory()
    nodes = f"{node.addr},{other.addr}"
    res = run_cli("generate", "--model", str(model), "--nodes", nodes, "--split", "0-1,2-2",
                  "--token", TOKEN, "--max-tokens", "4", "hello")
    assert res.returncode == 1, res.stdout
    err = res.stderr.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert "layers 0-1" in err and "144 MiB once loaded" in err and "--memory-mb is 200" in err, err
    ok = run_cli("generate", "--model", str(model), "--nodes", nodes, "--split", "0-0,1-2",
                 "--token", TOKEN, "--max-tokens", "4", "hello")
    assert ok.returncode == 0, ok.stderr
    with open(f"/proc/{node.proc.pid}/status") as f:
        peak = next(int(x.split()[1]) for x in f if x.startswith("VmHWM")) / 1024
    assert peak <= 200, peak


def test_a_node_counts_what_layers_hold_with_its_own_products(ggufs, node_factory, tmp_path) -> None:
    """A layer that holds 72 MiB with onnxruntime's MatMulNBits and 2 MiB with edgelite's own
    products (the manifest's narrow figure): a node that runs every kind its layers list takes
    two within 200 MiB; the same node with --no-matmul-kernel refuses them, naming what it
    counted."""
    import dataclasses

    from edgelite.config import RuntimeConfig
    from edgelite.engine.passes import linear
    from edgelite_export import build

    model = build.run(str(ggufs["Q4_1"]), tmp_path / "big", build.Options(steps=4)).out
    m = mf.load(model)
    if not linear.narrow(RuntimeConfig(threads=1), m):
        pytest.skip("this CPU has no vector path for MatMul4: its products are not narrow here")
    big = [dataclasses.replace(e, resident_bytes=72 << 20, narrow_resident_bytes=2 << 20) for e in m.layers]
    mf.write(dataclasses.replace(m, layers=big, range_bytes=0, narrow_range_bytes=0), model)
    for extra, code in (((), 0), (("--no-matmul-kernel",), 1)):
        node, other = node_factory(memory_mb=200, extra=extra), node_factory()
        res = run_cli("generate", "--model", str(model), "--nodes", f"{node.addr},{other.addr}", "--split",
                      "0-1,2-2", "--token", TOKEN, "--max-tokens", "4", "hello")
        assert res.returncode == code, res.stderr
        said = "144 MiB once loaded" in res.stderr and "--memory-mb is 200" in res.stderr
        assert code == 0 or said, res.stderr


def test_a_plan_of_small_chunks_is_kept_to_them(exported, node_factory) -> None:
    """A plan whose memory was counted for prompt chunks of 16 tokens: the client sends its
    prompt in chunks of at most 16 (the same tokens as locally), and the node refuses a step
    of more, naming the limit."""
    import dataclasses

    import numpy as np

    from edgelite.errors import EdgeliteError

    model = exported["llama"]
    m = mf.load(model)
    nodes = [node_factory()]
    prompt = list(range(3, 43))  # 40 tokens: 16 + 16 + 8
    local = asyncio.run(_tokens(LocalBackend(m, RuntimeConfig(threads=1)), prompt))

    async def run() -> tuple[list[int], str]:
        plan = dataclasses.replace(split_plan([(0, m.num_layers - 1)], [NodeAddr.parse(nodes[0].addr)],
                                              m.num_layers), max_chunk=16)
        backend = await open_backend(m, plan, TOKEN, None, RuntimeConfig(threads=1))
        try:
            got = await _tokens(backend, prompt, session="s1")
            assert isinstance(backend, ClusterBackend)
            backend.plane.part.cfg = dataclasses.replace(backend.plane.part.cfg, prefill_chunks=(64,))
            try:  # (a client that ignores the plan's limit)
                await backend.forward("s2", np.array([prompt[:17]], np.int64))
            except EdgeliteError as exc:
                return got, str(exc)
            return got, ""
        finally:
            await backend.close()

    got, refused = asyncio.run(run())
    assert got == local
    assert "1-16 tokens" in refused and "chunks of 16" in refused, refused
