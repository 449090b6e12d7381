"""The KV store on its own: prefixes found by chained block hashes, token ids compared, atomic
files, an index rebuilt from them, a disk budget; and 100 ways of corrupting its files, each a
miss (or the right KV), never wrong KV or a crash."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import edgelite
from edgelite.cli.localnodes import TOKEN
from edgelite.config import WireLimits
from edgelite.engine.kvfile import Layout, encode, layout_from_json, read_header
from edgelite.engine.kvstore import KVStore, block_hashes
from edgelite.errors import NodeError
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.net.link import NodeLink
from edgelite.planner.model import Plan, Stage

LAYOUT = Layout("f" * 64, 0, 2, 2, 8)
BLOCK = 16


def kv_for(tokens: np.ndarray, layout: Layout = LAYOUT) -> np.ndarray:
    """KV that depends on every token before a position (as real KV does)."""
    acc = np.cumsum(np.asarray(tokens, np.float64) % 97).astype(np.float32)
    base = np.arange(np.prod(layout.shape(1)), dtype=np.float32).reshape(layout.shape(1))
    return np.ascontiguousarray(base * 0.01 + acc[None, None, None, :, None])


def toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


@pytest.mark.unit
def test_float16_kv_is_stored_at_its_width_and_only_for_its_layout(tmp_path: Path) -> None:
    store = KVStore(tmp_path, 1 << 30, BLOCK)
    half = Layout("f" * 64, 0, 2, 2, 8, "float16")
    a = toks(40)
    kv = kv_for(a).astype(np.float16)
    assert store.put(half, a, kv) > 0
    entry = sum(p.stat().st_size for p in tmp_path.glob("*.kv"))
    assert kv.nbytes < entry < kv.nbytes + 4096  # 2 bytes a value, and the header
    hit = store.get(half, a)
    assert hit is not None and hit.kv.dtype == np.float16 and np.array_equal(hit.kv, kv)
    assert store.get(LAYOUT, a) is None  # the float32 layout's query misses it
    assert layout_from_json(half.to_json()) == half


@pytest.mark.unit
def test_the_longest_stored_prefix_comes_back_exactly(tmp_path: Path) -> None:
    store = KVStore(tmp_path, 1 << 30, BLOCK)
    a = toks(70)
    kv = kv_for(a)
    assert store.put(LAYOUT, a, kv) > 0
    hit = store.get(LAYOUT, a)
    assert hit is not None and hit.length == 70 and np.array_equal(hit.kv, kv)
    # a prompt that goes on past the entry: all 70; one that leaves it at token 40: 40
    longer = np.concatenate([a, toks(30, 1)])
    assert store.get(LAYOUT, longer).length == 70
    fork = a.copy()
    fork[40] += 1
    hit = store.get(LAYOUT, fork)
    assert hit is not None and hit.length == 40 and np.array_equal(hit.kv, kv[:, :, :, :40])
    assert store.get(LAYOUT, a, at_most=33).length == 33
    # less than a block in common, another model, another layer range: misses
    fork[5] += 1
    assert store.get(LAYOUT, fork) is None
    other = Layout("e" * 64, 0, 2, 2, 8)
    assert store.get(other, a) is None
    assert store.get(Layout("f" * 64, 0, 1, 2, 8), a) is None
    assert store.put(LAYOUT, a[:10], kv_for(a[:10])) == 0  # shorter than a block: not kept


@pytest.mark.unit
def test_some_layers_of_an_entry_come_back_and_a_peers_layout_is_checked(tmp_path: Path) -> None:
    store = KVStore(tmp_path, 1 << 30, BLOCK)
    a = toks(50)
    kv = kv_for(a)
    store.put(LAYOUT, a, kv)
    into = np.full((2, 2, 2, 64, 8), np.nan, np.float32)
    hit = store.get(LAYOUT, a, into=into, layers=range(1, 3))
    assert hit is not None and hit.length == 50 and np.array_equal(hit.kv, kv[1:3])
    assert np.isnan(into[:, :, :, 50:]).all()  # nothing written past the prefix
    with pytest.raises(ValueError, match="layers"):
        store.get(LAYOUT, a, layers=range(2, 4))

    good = LAYOUT.to_json()
    assert layout_from_json(good) == LAYOUT
    for bad in (None, [], {**good, "extra": 1}, {**good, "first": "0"}, {**good, "first": 3},
                {**good, "kv_heads": 0}, {**good, "dtype": "int4"}, {**good, "last": 1 << 20},
                {**good, "fingerprint": 5}, {k: v for k, v in good.items() if k != "head_dim"}):
        with pytest.raises(ValueError):
            layout_from_json(bad)


@pytest.mark.unit
def test_placements_point_each_stage_at_where_its_layers_were_stored(tmp_path: Path,
                                                                     monkeypatch) -> None:
    from edgelite.client import placements as pl

    monkeypatch.setenv("EDGELITE_HOME", str(tmp_path))
    x, y, z = (NodeAddr("10.0.0.1", p) for p in (7070, 7071, 7072))
    old = (pl.Span(None, 0, 3), pl.Span(x, 4, 9), pl.Span(y, 10, 15))
    assert pl.load("fp") is None
    pl.record("fp", old)
    pl.record("other", (pl.Span(None, 0, 15),))
    assert pl.load("fp") == old
    assert pl.sources(old, pl.Span(x, 4, 9)) == []  # its own entries
    assert pl.sources(old, pl.Span(z, 6, 12)) == [m.KvSource(4, 9, x), m.KvSource(10, 15, y)]
    assert pl.sources(old, pl.Span(x, 4, 12)) == [m.KvSource(4, 9, None), m.KvSource(10, 15, y)]
    assert pl.sources(old, pl.Span(z, 2, 5)) == []  # layers 2-3 were on the client
    assert pl.sources(None, pl.Span(z, 4, 9)) == []
    (tmp_path / pl.FILE).write_text("{broken")
    assert pl.load("fp") is None  # a miss, never an error
    (tmp_path / pl.FILE).write_text(json.dumps({"fp": [{"addr": "nowhere", "first": 0, "last": 1}]}))
    assert pl.load("fp") is None
    pl.record("fp", old)
    assert pl.load("fp") == old


@pytest.mark.unit
def test_an_extended_conversation_replaces_its_older_entry_and_the_budget_holds(tmp_path: Path) -> None:
    store = KVStore(tmp_path, 1 << 30, BLOCK)
    a = toks(100)
    store.put(LAYOUT, a[:40], kv_for(a[:40]))
    store.put(LAYOUT, a, kv_for(a))
    assert store.entries == 1 and store.get(LAYOUT, a[:40]).length == 40
    one = store.bytes_used
    small = KVStore(tmp_path / "small", int(one * 2.5), BLOCK)
    for seed in range(4):
        small.put(LAYOUT, toks(100, seed + 10), kv_for(toks(100, seed + 10)))
        time.sleep(0.01)
    assert small.entries == 2 and small.bytes_used <= small.budget
    assert small.get(LAYOUT, toks(100, 13)) is not None and small.get(LAYOUT, toks(100, 10)) is None
    assert small.stats()["evicted"] == 2



@pytest.mark.unit
def test_a_save_written_behind_is_found_by_the_next_lookup_and_its_copies_are_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """put_later returns before the disk write (a finished request does not wait for fsync);
    a lookup waits for the writes queued before it, so it finds them; a save beyond
    max_pending_bytes of waiting copies waits; a write that fails is a logged miss."""
    import threading

    from edgelite.engine import kvstore

    gate = threading.Event()
    real = kvstore.write_atomic

    def slow(path: Path, parts: list[bytes]) -> None:
        assert gate.wait(10)
        real(path, parts)

    monkeypatch.setattr(kvstore, "write_atomic", slow)
    a, b = toks(100, 1), toks(100, 2)
    store = KVStore(tmp_path, 1 << 30, BLOCK, max_pending_bytes=kv_for(a).nbytes + 1)
    t0 = time.monotonic()
    assert store.put_later(LAYOUT, a, kv_for(a)) == kv_for(a).nbytes
    assert time.monotonic() - t0 < 1 and store.entries == 0  # queued, not written
    second = threading.Thread(target=store.put_later, args=(LAYOUT, b, kv_for(b)))
    found: list[int] = []
    lookup = threading.Thread(target=lambda: found.append(store.longest(LAYOUT, a)))
    second.start()
    lookup.start()
    second.join(0.3)
    lookup.join(0.3)
    assert second.is_alive() and lookup.is_alive()  # over the bound; before the write
    gate.set()
    second.join(10)
    lookup.join(10)
    assert found == [100] and store.longest(LAYOUT, b) == 100 and store.entries == 2
    assert np.array_equal(store.get(LAYOUT, b).kv, kv_for(b))

    def full(path: Path, parts: list[bytes]) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvstore, "write_atomic", full)
    c = toks(100, 3)
    assert store.put_later(LAYOUT, c, kv_for(c)) > 0
    assert store.longest(LAYOUT, c) == 0 and store.entries == 2
    assert "could not be written" in caplog.text
    store.close()
    with pytest.raises(ValueError):  # the KV's shape is checked before it is queued
        KVStore(tmp_path / "other", 1 << 30, BLOCK).put_later(LAYOUT, c, kv_for(c)[:, :1])


@pytest.mark.unit
def test_a_hash_collision_cannot_return_wrong_kv(tmp_path: Path) -> None:
    """Make the index claim another sequence's block hash: the token ids decide."""
    store = KVStore(tmp_path, 1 << 30, BLOCK)
    a, b = toks(48, 1), toks(48, 2)
    store.put(LAYOUT, a, kv_for(a))
    name = store.db.execute("SELECT name FROM entries").fetchone()[0]
    for i, h in enumerate(block_hashes(LAYOUT, b, BLOCK)):
        store.db.execute("INSERT INTO blocks VALUES (?, ?, ?)", (h, name, i + 1))
    assert store.get(LAYOUT, b) is None


@pytest.mark.unit
def test_the_index_is_rebuilt_from_the_files(tmp_path: Path) -> None:
    store = KVStore(tmp_path, 1 << 30, BLOCK)
    a = toks(64)
    store.put(LAYOUT, a, kv_for(a))
    store.close()
    (tmp_path / "index.sqlite").write_bytes(b"this is not a database" * 100)
    for extra in ("index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / extra).unlink(missing_ok=True)
    again = KVStore(tmp_path, 1 << 30, BLOCK)
    hit = again.get(LAYOUT, a)
    assert hit is not None and np.array_equal(hit.kv, kv_for(a))
    again.close()
    (tmp_path / "index.sqlite").unlink()
    assert KVStore(tmp_path, 1 << 30, BLOCK).get(LAYOUT, a).length == 64


# ---- corruption -------------------------------------------------------------------------
def _patch_header(raw: bytes, change: Callable[[dict], int | None]) -> bytes:
    """The entry with its header's JSON changed and its checksum made right again."""
    magic, version, length = struct.unpack_from("<8sII", raw)
    meta = json.loads(raw[16:16 + length])
    version = change(meta) or version
    body = json.dumps(meta, sort_keys=True).encode()
    import hashlib

    head = struct.pack("<8sII", magic, version, len(body)) + body
    return head + hashlib.sha256(head).digest() + raw[16 + length + 32:]


def _corruptions(good: bytes, other: bytes) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(5)
    out: list[tuple[str, bytes]] = []
    for cut in np.linspace(0, len(good) - 1, 30).astype(int):
        out.append((f"truncated at {cut}", good[:cut]))
    for pos in sorted(set(rng.choice(len(good), 47, replace=False).tolist()) | {0, 9, 13, 20, len(good) - 1}):
        b = bytearray(good)
        b[pos] ^= 1 << int(rng.integers(0, 8))
        out.append((f"bit flipped at {pos}", bytes(b)))
    hl = 16 + struct.unpack_from("<I", good, 12)[0] + 32
    ol = 16 + struct.unpack_from("<I", other, 12)[0] + 32
    out.append(("header of another entry", other[:ol] + good[hl:]))
    out.append(("payload of another entry", good[:hl] + other[ol:]))
    out.append(("another entry whole", other))
    out.append(("zeros", bytes(len(good))))
    out.append(("empty", b""))
    out.append(("doubled", good + good))
    out.append(("one byte more", good + b"\0"))

    def fingerprint(meta: dict) -> None:
        meta["layout"]["fingerprint"] = "0" * 64

    def layers(meta: dict) -> None:
        meta["layout"]["last"] = 1

    def dtype(meta: dict) -> None:
        meta["layout"]["dtype"] = "float16"

    def heads(meta: dict) -> None:
        meta["layout"]["kv_heads"] = 1

    def count(meta: dict) -> None:
        meta["tokens"] -= 1

    def sections(meta: dict) -> None:
        meta["sections"] = meta["sections"][:1]

    def version(meta: dict) -> int:
        return 2

    def garbage(meta: dict) -> None:
        meta["layout"] = "nothing"

    for name, change in (("wrong fingerprint", fingerprint), ("wrong layer range", layers),
                         ("wrong dtype", dtype), ("wrong kv heads", heads),
                         ("wrong token count", count), ("a section missing", sections),
                         ("a newer format version", version), ("layout not an object", garbage)):
        out.append((name, _patch_header(good, change)))
    for cut in np.linspace(1, len(good) - 1, 5).astype(int):  # what a killed writer leaves
        out.append((f"temporary file of {cut} bytes", good[:cut]))
    return out


@pytest.mark.unit
def test_100_corruptions_are_misses_never_wrong_kv(tmp_path: Path) -> None:
    a, b = toks(40, 3), toks(40, 4)
    src = KVStore(tmp_path / "src", 1 << 30, BLOCK)
    src.put(LAYOUT, a, kv_for(a))
    src.put(LAYOUT, b, kv_for(b))
    files = {read_header(p)[1].tobytes(): p for p in (tmp_path / "src").glob("*.kv")}
    good, other = files[a.tobytes()].read_bytes(), files[b.tobytes()].read_bytes()
    name = files[a.tobytes()].name
    cases = _corruptions(good, other)
    assert len(cases) >= 100, len(cases)
    wrong, found = [], 0
    for i, (what, data) in enumerate(cases):
        root = tmp_path / f"c{i}"
        for warm in (False, True):  # the file changed under a live index, or found at start
            d = root / ("warm" if warm else "cold")
            d.mkdir(parents=True)
            at = d / (f".tmp-{name}-1-0" if what.startswith("temporary") else name)
            if warm:
                store = KVStore(d, 1 << 30, BLOCK)
                store.put(LAYOUT, a, kv_for(a))
                at.write_bytes(data)
            else:
                at.write_bytes(data)
                store = KVStore(d, 1 << 30, BLOCK)
            # read into a slot-like array (more positions than the entry) or a new array
            into = np.full((*LAYOUT.shape(1)[:3], 64, LAYOUT.head_dim), 7.0, np.float32)
            hit = store.get(LAYOUT, a, into=into if warm else None)
            if hit is not None:
                found += 1
                if not np.array_equal(hit.kv, kv_for(a)[:, :, :, :hit.length]):
                    wrong.append(what)
                if warm and not (np.shares_memory(hit.kv, into) and (into[:, :, :, hit.length:] == 7).all()):
                    wrong.append(f"{what} (not in place)")
            # a corrupt entry is dropped: asking again is a plain miss (or the same right hit)
            again = store.get(LAYOUT, a)
            assert (again is None) == (hit is None), what
            store.close()
    assert wrong == []
    assert found == 5  # the warm store's own entry, beside a killed writer's temporary file


WRITER = r"""
import sys, numpy as np
from pathlib import Path
import edgelite
from edgelite.cli.localnodes import TOKEN
from edgelite.ids import NodeAddr
from edgelite.planner.model import Plan, Stage
from edgelite.engine.kvfile import Layout
from edgelite.engine.kvstore import KVStore
layout = Layout("f" * 64, 0, 29, 3, 64)
store = KVStore(Path(sys.argv[1]), 1 << 40, 16)
tokens = np.arange(2000, dtype=np.int32)
kv = np.ones(layout.shape(2000), np.float32)
print("ready", flush=True)
while True:
    store.put(layout, tokens, kv)
    tokens = tokens + 1
"""


@pytest.mark.e2e  # (a writer process, killed)
def test_a_writer_killed_mid_write_leaves_nothing_that_reads_as_an_entry(tmp_path: Path) -> None:
    layout = Layout("f" * 64, 0, 29, 3, 64)
    for delay in (0.05, 0.3, 0.7):
        d = tmp_path / f"k{delay}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(d)], stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
        store = KVStore(d, 1 << 40, 16)
        assert not list(d.glob(".tmp-*"))  # a killed writer's temporary file is cleaned up
        for row in store.db.execute("SELECT tokens FROM entries").fetchall():
            t = np.frombuffer(row[0], np.int32)
            hit = store.get(layout, t)
            assert hit is not None and hit.length == len(t) and np.all(hit.kv == 1.0)
        store.close()



@pytest.mark.unit
def test_encode_round_trips_the_header() -> None:
    t = toks(20)
    header, payload = encode(LAYOUT, t, kv_for(t))
    assert header.startswith(b"EDGELKV") and len(payload) == 2


# ---- on real node processes -------------------------------------------------------------
def _plan(nodes: list) -> Plan:
    stages = [Stage(f"n{i}", i + 1, i + 1, NodeAddr.parse(x.addr)) for i, x in enumerate(nodes)]
    return Plan((Stage("client", 0, 0), *stages), "latency", "split", "given")


def _split(*spans: tuple) -> Plan:
    """The client holds layer 0; each (node, first, last) a range of the others."""
    return Plan((Stage("client", 0, 0), *(Stage(f"n{i}", a, b, NodeAddr.parse(x.addr))
                                          for i, (x, a, b) in enumerate(spans))),
                "latency", "split", "given")


async def _turn(model: Path, nodes: list, prompt: list[int], n: int = 8,
                reuse: bool = True, plan: Plan | None = None) -> tuple[list[int], int]:
    """One reply on a fresh client that holds layer 0, two nodes one layer each (or `plan`):
    its ids, and the prompt tokens imported from the stores. Afterwards no node holds KV: a
    restore that missed freed the slot it had reserved."""
    async with edgelite.connect(model, nodes=[x.addr for x in nodes], token=TOKEN,
                                plan=plan or _plan(nodes)) as llm:
        reply = llm.complete(prompt, max_tokens=n, reuse=reuse)
        await reply.collect()
        stats = list((await llm.backend.inner.cluster.stats()).values())
        assert all(s["sessions"] == 0 and s["kv_bytes"] == 0 for s in stats), stats
        assert not llm.backend.recoveries  # no node was lost, nor taken for lost
        return reply.token_ids, reply.stats.reused_tokens


@pytest.mark.e2e
def test_a_conversation_resumes_after_every_process_restarted(exported, node_factory, tmp_path) -> None:
    model = exported["llama"]
    first = np.random.default_rng(1).integers(3, 200, 90).tolist()
    more = np.random.default_rng(2).integers(3, 200, 30).tolist()

    def conversation(tag: str, restart: bool) -> tuple[list[int], list[int], int, list]:
        dirs = [tmp_path / f"{tag}{i}" for i in range(2)]
        nodes = [node_factory(data_dir=d) for d in dirs]
        reply1, reused1 = asyncio.run(_turn(model, nodes, first))
        assert reused1 == 0
        if restart:
            for n in nodes:
                n.kill()
            nodes = [node_factory(data_dir=d) for d in dirs]
        reply2, reused2 = asyncio.run(_turn(model, nodes, first + reply1 + more))
        return reply1, reply2, reused2, nodes

    reply1, resumed, reused, nodes = conversation("r", restart=True)
    home = os.environ["EDGELITE_HOME"]
    os.environ["EDGELITE_HOME"] = str(tmp_path / "home-s")  # nothing of the first conversation
    try:
        _, straight, reused_straight, _ = conversation("s", restart=False)
    finally:
        os.environ["EDGELITE_HOME"] = home
    assert resumed == straight and reused == reused_straight
    assert 90 <= reused <= 90 + 7  # the first turn's prompt and reply (the KV it computed)

    # every entry on one node corrupted: a miss there, so all is computed: the same ids
    for f in (nodes[1].data_dir / "kv").glob("*.kv"):
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        f.write_bytes(bytes(raw))
    again, reused_again = asyncio.run(_turn(model, nodes, first + reply1 + more))
    assert reused_again == 0 and again == straight


@pytest.mark.e2e
def test_a_clients_kv_on_the_nodes_is_its_own(exported, node_factory) -> None:
    """Nodes keep each client's KV under its own key: another client (another KV key) with the
    same prompt imports none of it, and neither a restore nor a kv_export built from the public
    manifest's layout reads it; the client that computed it (the key kept in its home) does."""
    model = exported["llama"]
    nodes = [node_factory(), node_factory()]
    prompt = np.random.default_rng(5).integers(3, 200, 70).tolist()
    key_file = Path(os.environ["EDGELITE_HOME"]) / "kv_key"
    ids, reused = asyncio.run(_turn(model, nodes, prompt))
    assert reused == 0 and key_file.exists()
    mine = key_file.read_text()
    key_file.unlink()  # another client: its own key (the client's own store still hits)
    other, reused = asyncio.run(_turn(model, nodes, prompt))
    assert other == ids and reused == 0
    key_file.write_text(mine)  # the first client again: its KV comes back
    again, reused = asyncio.run(_turn(model, nodes, prompt))
    assert again == ids and reused >= 64, reused
    asyncio.run(_export_needs_the_domain(nodes[0]))


async def _export_needs_the_domain(node) -> None:
    layout, stored = read_header(next((node.data_dir / "kv").glob("*.kv")))
    assert layout.domain
    link = await NodeLink.open(NodeAddr.parse(node.addr), TOKEN, None, WireLimits(), 5)
    try:
        for lay, found in ((replace(layout, domain=""), False), (layout, True)):
            ready = await link.request(m.KvExport(id=0, layout=lay.to_json(), tokens=stored.tobytes(),
                                                  first=lay.first, last=lay.first), m.KvExportReady, 5)
            assert (ready.length > 0) == found, (lay, ready)
            if ready.handle:
                await link.request(m.KvExportRead(id=0, handle=ready.handle, offset=0),
                                   m.KvExportData, 5)
    finally:
        await link.close()


@pytest.mark.e2e
def test_a_conversation_moves_to_plans_that_split_the_model_otherwise(exported, node_factory) -> None:
    """Each plan's stages take their layers' KV from where the plan before held them: from
    their own store under a wider range, and from the node that held them (kv_export), or
    both; the prefix is imported, not computed, and the ids equal computing it. A source node
    that is gone makes it a miss: all is computed, the same ids."""
    model = exported["llama"]
    x, y, z = node_factory(), node_factory(extra=("--set", "kv_fetch_timeout_s=2")), node_factory()
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, 200, 80).tolist()
    plans = [_split((x, 1, 2)),  # the conversation starts on one node
             _split((x, 1, 1), (y, 2, 2)),  # x: its own entry of 1-2; y: layer 2 from x
             _split((y, 1, 2)),  # y: layer 1 from x, layer 2 its own
             _split((z, 1, 1), (x, 2, 2))]  # z: layer 1 from y; x: layer 2 from y
    held = 0  # the prompt tokens of the turn before (whose KV it stored, with its reply's)
    for i, plan in enumerate(plans):
        expected, _ = asyncio.run(_turn(model, [x, y, z], prompt, plan=plan, reuse=False))
        ids, reused = asyncio.run(_turn(model, [x, y, z], prompt, plan=plan))
        assert ids == expected, i
        assert reused == 0 if i == 0 else held <= reused < len(prompt), (i, reused)
        held, prompt = len(prompt), prompt + ids + rng.integers(3, 200, 10).tolist()
    served = [asyncio.run(_stats(n))["kv_exports"] for n in (x, y)]
    assert [s["served"] for s in served] == [2, 2] and all(s["held"] == 0 for s in served), served

    asyncio.run(_export_is_its_askers(x))

    x.kill()  # z would take layer 2 from x, which held it last: gone
    plan = _split((z, 1, 2))
    expected, _ = asyncio.run(_turn(model, [y, z], prompt, plan=plan, reuse=False))
    ids, reused = asyncio.run(_turn(model, [y, z], prompt, plan=plan))
    assert ids == expected and reused == 0

    # a source that hangs (stopped: its port accepts, nothing answers) costs the stage at most
    # its kv_fetch_timeout_s (2 s on y), and meanwhile the client's heartbeat still hears y
    # (no recovery: _turn checks), though y's kv_restore is under way on the same connection
    prompt = prompt + ids + rng.integers(3, 200, 10).tolist()
    plan = _split((y, 1, 2))  # y: layers 1-2 from z, which held them last
    expected, _ = asyncio.run(_turn(model, [y], prompt, plan=plan, reuse=False))
    os.kill(z.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        ids, reused = asyncio.run(_turn(model, [y], prompt, plan=plan))
        took = time.monotonic() - t0
    finally:
        os.kill(z.proc.pid, signal.SIGCONT)
    assert ids == expected and 2 <= took < 10, took


async def _export_is_its_askers(node) -> None:
    """A KV export is read only on the connection that asked for it, and dropped with it."""
    layout, stored = read_header(next((node.data_dir / "kv").glob("*.kv")))
    addr = NodeAddr.parse(node.addr)
    asker = await NodeLink.open(addr, TOKEN, None, WireLimits(), 5)
    other = await NodeLink.open(addr, TOKEN, None, WireLimits(), 5)
    try:
        ready = await asker.request(m.KvExport(id=0, layout=layout.to_json(), tokens=stored.tobytes(),
                                               first=layout.first, last=layout.first), m.KvExportReady, 5)
        assert ready.length == len(stored) and ready.handle
        with pytest.raises(NodeError, match="no such export"):
            await other.request(m.KvExportRead(id=0, handle=ready.handle, offset=0), m.KvExportData, 5)
        assert (await _stats(node))["kv_exports"]["held"] == 1
        # requests of a connection run side by side: exports being read count against
        # max_kv_exports (8) before their read ends, so 8 more at once leave one refused
        ask = m.KvExport(id=0, layout=layout.to_json(), tokens=stored.tobytes(), first=layout.first,
                         last=layout.first)
        got = await asyncio.gather(*(asker.request(ask, m.KvExportReady, 5) for _ in range(8)),
                                   return_exceptions=True)
        refused = [g for g in got if isinstance(g, NodeError)]
        assert len(refused) == 1 and "max_kv_exports" in str(refused[0]), got
        assert (await _stats(node))["kv_exports"]["held"] == 8
    finally:
        await asker.close()
        await other.close()
    deadline = time.monotonic() + 5
    while (await _stats(node))["kv_exports"]["held"]:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def _stats(node) -> dict:
    link = await NodeLink.open(NodeAddr.parse(node.addr), TOKEN, None, WireLimits(), 5)
    try:
        return (await link.request(m.StatsRequest(id=0), m.StatsReply, 5)).stats
    finally:
        await link.close()


@pytest.mark.e2e
def test_steps_wait_for_a_restore_still_reading_and_a_failed_one_is_computed(exported, node_factory,
                                                                            tmp_path) -> None:
    """A node answers kv_restore once its index has found the prefix and reads the entry
    meanwhile: the session's steps that arrive first wait for the read (here the entry is a
    FIFO the test fills only once a step waits on it), then run; when the entry read that way
    turns out corrupt, the waiting steps fail and the client computes the prompt instead; a
    step beyond `max_waiting_steps` is refused (the prompt's second chunk, with a limit of 1),
    and the client computes the prompt too. The same ids every time, and no KV left on the
    nodes."""
    model = exported["llama"]
    rng = np.random.default_rng(3)
    plain = [node_factory(data_dir=tmp_path / f"w{i}") for i in range(2)]
    strict = [node_factory(data_dir=tmp_path / f"s{i}", extra=("--set", "max_waiting_steps=1"))
              for i in range(2)]

    async def held_turn(nodes: list, prompt: list[int], corrupt: bool) -> tuple[list[int], int]:
        held = NodeAddr.parse(nodes[0].addr)
        [entry] = list((nodes[0].data_dir / "kv").glob("*.kv"))
        raw = bytearray(entry.read_bytes())
        if corrupt:
            raw[-len(raw) // 3] ^= 0x10  # in the KV section
        entry.unlink()
        os.mkfifo(entry)
        async with edgelite.connect(model, nodes=[x.addr for x in nodes], token=TOKEN,
                                    plan=_plan(nodes)) as llm:
            reply = llm.complete(prompt, max_tokens=8)
            task = asyncio.create_task(reply.collect())
            # watched on a connection of its own: the client's waits behind its `end` of the
            # session when a refused step made it give the stored KV up
            watch = await NodeLink.open(held, TOKEN, None, WireLimits(), 5)
            try:
                deadline = time.monotonic() + 30
                while (await watch.request(m.StatsRequest(id=0), m.StatsReply, 5)).stats[
                        "steps_waiting_for_restores"] == 0:
                    assert time.monotonic() < deadline and not task.done()
                    await asyncio.sleep(0.01)
            finally:
                await watch.close()
            await asyncio.to_thread(entry.write_bytes, bytes(raw))  # the node reads it now
            await task
            stats = list((await llm.node_stats()).values())
            assert all(s["sessions"] == 0 and s["kv_bytes"] == 0 and s["restores"] == 0
                       and s["steps_waiting_for_restores"] == 0 for s in stats), stats
            return reply.token_ids, reply.stats.reused_tokens

    prompt = rng.integers(3, 200, 90).tolist()
    for nodes, corrupt, imported in ((plain, False, True), (plain, True, False), (strict, False, False)):
        reply, _ = asyncio.run(_turn(model, nodes, prompt))  # stored on every part
        prompt = prompt + reply + rng.integers(3, 200, 20).tolist()
        expected, _ = asyncio.run(_turn(model, nodes, prompt, reuse=False))
        ids, reused = asyncio.run(held_turn(nodes, prompt, corrupt))
        assert ids == expected
        assert reused >= 90 if imported else reused == 0


@pytest.mark.engine
def test_chat_session_continues_a_conversation_from_its_file(exported, tmp_path) -> None:
    model = exported["llama"]
    env = {**os.environ, "EDGELITE_HOME": str(tmp_path)}

    def chat(*lines: str, session: str = "trip") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "edgelite", "chat", "--model", str(model),
                               "--plain", "--max-tokens", "6", "--session", session],
                              input="".join(line + "\n" for line in lines), capture_output=True,
                              text=True, timeout=120, env=env)

    first = chat("tell me about the sea and the ships that sail on it")
    assert first.returncode == 0, first.stderr
    saved = json.loads((tmp_path / "sessions" / "trip.json").read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"]
    second = chat("and about the harbour")
    assert second.returncode == 0, second.stderr
    assert "session trip: 1 turns so far" in second.stdout
    assert "prompt tokens from the KV store" in second.stdout  # only the new turn was computed
    saved = json.loads((tmp_path / "sessions" / "trip.json").read_text())["messages"]
    assert len(saved) == 4 and saved[2]["content"] == "and about the harbour"

    bad = chat("hi", session="no such name!")
    assert bad.returncode != 0 and "session name" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "sessions" / "broken.json").write_text("{not json")
    broken = chat("hi", session="broken")
    assert broken.returncode != 0 and "cannot be read" in broken.stderr
    assert "Traceback" not in broken.stderr


@pytest.mark.engine
def test_a_restore_fills_a_reserved_slot_that_is_the_sessions_only_when_it_passed(exported, tmp_path,
                                                                                  monkeypatch) -> None:
    """The client part's restore: the entry is read straight into a reserved slot; a corrupt
    entry frees it and leaves every live session as it was; a second restore of the same
    session at once is refused."""
    from edgelite import manifest as mf
    from edgelite.client.local import restore_part
    from edgelite.config import RuntimeConfig
    from edgelite.engine.runtime import ClientPart
    from edgelite.errors import EdgeliteError

    monkeypatch.setenv("EDGELITE_HOME", str(tmp_path))
    part = ClientPart(mf.load(exported["llama"]), RuntimeConfig(threads=1), (0, 0))
    assert part.prefix is not None and part.store is not None
    pool, layout = part.prefix.pool, part.prefix.layout
    part.front("live", np.array([[5, 6, 7]]))
    live = pool.read(part.slots["live"], 3)
    tokens = list(range(3, 40))
    kv = np.random.default_rng(0).standard_normal(layout.shape(len(tokens))).astype(np.float32)
    part.store.put(layout, np.array(tokens, np.int32), kv)

    async def on_thread(fn):
        return fn()

    assert asyncio.run(restore_part(part, "b", tokens, on_thread)) == len(tokens)
    assert part.slots["b"].length == len(tokens) and not part.restoring
    assert np.array_equal(pool.read(part.slots["b"], len(tokens)), kv)

    (entry,) = (tmp_path / "kv").glob("*.kv")
    raw = bytearray(entry.read_bytes())
    raw[-100] ^= 0x01  # a bit of the KV section
    entry.write_bytes(bytes(raw))
    assert asyncio.run(restore_part(part, "c", tokens, on_thread)) == 0
    assert "c" not in part.slots and not part.restoring and pool.sessions == 2
    assert np.array_equal(pool.read(part.slots["live"], 3), live)

    slot = part.reserve("d")
    with pytest.raises(EdgeliteError, match="being restored"):
        part.reserve("d")
    part.abandon("d", slot)
    assert pool.sessions == 2 and not part.restoring


@pytest.mark.unit
def test_crafted_files_in_the_store_are_misses_not_a_start_up_failure(tmp_path: Path) -> None:
    """Entry files with a valid header checksum but any JSON inside (sections of the wrong
    shape, a layout of the wrong types) are removed with a log line when the store opens; the
    store starts and the good entry is still found."""
    import hashlib
    import json
    import struct

    from edgelite.engine import kvfile

    good = KVStore(tmp_path, 1 << 30, BLOCK)
    a = toks(40, 1)
    good.put(LAYOUT, a, kv_for(a))
    good.close()

    def crafted(name: str, meta: object) -> None:
        body = json.dumps(meta).encode()
        fixed = kvfile._HEAD.pack(kvfile.MAGIC, kvfile.VERSION, len(body))
        (tmp_path / (name + kvfile.SUFFIX)).write_bytes(fixed + body + hashlib.sha256(fixed + body).digest())

    layout = LAYOUT.to_json()
    crafted("a" * 16, {"layout": layout, "tokens": 2, "sections": [1, 2]})
    crafted("b" * 16, {"layout": {**layout, "first": "zero"}, "tokens": 2, "sections": [[8, "x"], [0, "y"]]})
    crafted("c" * 16, {"layout": layout, "tokens": 2, "sections": [["8", "x"], [0, "y"]]})
    crafted("d" * 16, {"layout": [], "tokens": 1, "sections": [[4, "x"], [0, "y"]]})
    (tmp_path / ("e" * 16 + kvfile.SUFFIX)).write_bytes(struct.pack("<8sII", kvfile.MAGIC, 1, 1 << 30))
    (tmp_path / "index.sqlite").unlink()  # (indexed again from the files)
    store = KVStore(tmp_path, 1 << 30, BLOCK)
    assert store.entries == 1 and store.longest(LAYOUT, a) == len(a)
    left = [p.name for p in tmp_path.glob("*" + kvfile.SUFFIX)]
    assert len(left) == 1 and not left[0].startswith(tuple(c * 16 for c in "abcde")), left
    store.close()
