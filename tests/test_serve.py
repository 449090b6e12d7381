"""`edgelite serve`: 8 concurrent clients on a 2-node cluster whose KV budget forces preemption."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN, start_serve, stop_serve
from edgelite.config import GenerationConfig
from edgelite.errors import NodeUnavailable
from edgelite.ids import NodeAddr
from edgelite.net import messages as m
from edgelite.serve.client import GatewayClient

pytestmark = pytest.mark.e2e
USERS = [{"name": "free", "token": "t-free", "tier": 0}, {"name": "plus", "token": "t-plus", "tier": 1},
         {"name": "pro", "token": "t-pro", "tier": 2}]
PROMPTS = ["hello", "tell me a story", "what is a phone", "count to five", "the sky is",
           "name a colour", "why", "good morning to you"]


def _start_gateway(model: Path, nodes: list, users: Path, log) -> tuple[subprocess.Popen, int]:
    proc, found = start_serve(["--model", str(model), "--nodes", ",".join(n.addr for n in nodes),
                               "--split", "0-0,1-2", "--token", TOKEN, "--port", "0", "--users",
                               str(users), "--threads", "1", "--patience-s", "0.5"], log)
    return proc, int(found.group(1))


async def _client(port: int, user: dict, prompt: str) -> dict:
    c = await GatewayClient.connect(NodeAddr("127.0.0.1", port), user["name"], user["token"])
    try:
        text = "".join([p async for p in c.generate([{"role": "user", "content": prompt}],
                                                    GenerationConfig(max_tokens=12))])
        assert c.last is not None
        return {"token_ids": c.last.token_ids, "text": text}
    finally:
        await c.close()


def test_eight_clients_complete_with_preemption_and_solo_outputs(exported, node_factory,
                                                                 tmp_path: Path) -> None:
    model = exported["llama"]
    # 81 positions on the 2-layer stage, counted in buckets of 16: sessions grow past them
    # (one address, the gateway's, may hold max_address_kv_share of it: 0.02 MiB)
    nodes = [node_factory(kv_budget_mb=0.02 / 0.75, extra=("--kv-buckets", "16,32,48,64,128,256"))
             for _ in range(2)]
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"users": USERS}))
    log = tmp_path / "gateway.log"
    with log.open("w") as log_file:
        proc, port = _start_gateway(model, nodes, users, log_file)
    try:
        async def main() -> tuple[list[dict], dict]:
            done = await asyncio.gather(*(_client(port, USERS[i % 3], p)
                                          for i, p in enumerate(PROMPTS)))
            # a client that asks and hangs up: its request stops instead of running on
            quitter = await GatewayClient.connect(NodeAddr("127.0.0.1", port), "free", "t-free")
            await quitter.conn.send(m.GenerateRequest(id=1, prompt="bye", max_tokens=30))
            await quitter.close()
            c = await GatewayClient.connect(NodeAddr("127.0.0.1", port), "pro", "t-pro")
            try:
                for _ in range(100):
                    stats = await c.stats()
                    if sum(t["done"] for t in stats["tiers"].values()) + stats["cancelled"] > len(PROMPTS):
                        break
                    await asyncio.sleep(0.1)
                return list(done), stats
            finally:
                await c.close()

        results, stats = asyncio.run(asyncio.wait_for(main(), 180))

        async def intruder() -> None:
            await GatewayClient.connect(NodeAddr("127.0.0.1", port), "pro", "wrong")

        with pytest.raises(NodeUnavailable, match="wrong token"):
            asyncio.run(intruder())
        chat = subprocess.run([sys.executable, "-m", "edgelite", "chat", "--gateway",
                               f"127.0.0.1:{port}", "--user", "pro", "--max-tokens", "12"],
                              input="hello\n/stats\n/quit\n", capture_output=True, text=True,
                              timeout=60, env={**os.environ, "EDGELITE_USER_TOKEN": "t-pro"})
    finally:
        stop_serve(proc)
    for prompt, res in zip(PROMPTS, results, strict=True):
        solo = json.loads(run_cli("generate", "--model", str(model), "--json", "--max-tokens",
                                  "12", prompt).stdout)
        assert res["token_ids"] == solo["token_ids"], prompt
    assert sum(t["preemptions"] for t in stats["tiers"].values()) >= 1, stats
    # preempted requests came back from the KV stores (swap), not recomputed
    assert stats["resumed_tokens"]["swapped_in"] > 0, stats
    assert "preempted" in log.read_text()
    # the quitter's request was cancelled (or, if it had finished first, done)
    assert sum(t["done"] for t in stats["tiers"].values()) + stats["cancelled"] == len(PROMPTS) + 1
    assert stats["kv_tokens"]["budget"] <= 81 and stats["queues"]["running"] == 0
    assert set(stats["queues_by_tier"]) == {"0", "1", "2"}
    # `edgelite chat --gateway`: the reply (as text), the tier from users.json, then /stats
    assert chat.returncode == 0, chat.stderr
    assert results[0]["text"] in chat.stdout and "tier 2]" in chat.stdout
    assert "queues:" in chat.stdout and "tier 2:" in chat.stdout  # (/stats, as lines)


FIRST_TURN = [{"role": "user", "content": " ".join(f"word{i}" for i in range(40))}]


def _three_turns(model: Path, nodes: list, tmp_path: Path,
                 between: Callable[[], None] | None = None) -> list[tuple[str, list[int], int]]:
    """Through a gateway on `nodes`: a conversation's first turn, its next turn, and a request
    that shares nothing with them; (text, ids, prompt_tokens_reused so far) of each.
    `between`: run (in a thread) after the first turn."""
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"users": USERS}))
    with (tmp_path / "gateway.log").open("w") as log_file:
        proc, port = _start_gateway(model, nodes, users, log_file)
    try:
        async def ask(c: GatewayClient, messages: list[dict]) -> tuple[str, list[int], int]:
            text = "".join([p async for p in c.generate(messages, GenerationConfig(max_tokens=12))])
            assert c.last is not None
            return text, c.last.token_ids, (await c.stats())["prompt_tokens_reused"]

        async def main() -> list[tuple[str, list[int], int]]:
            c = await GatewayClient.connect(NodeAddr("127.0.0.1", port), "pro", "t-pro")
            try:
                one = await ask(c, FIRST_TURN)
                if between is not None:
                    await asyncio.to_thread(between)
                two = await ask(c, _next_turn(one[0]))
                three = await ask(c, [{"role": "user", "content": "something else"}])
                return [one, two, three]
            finally:
                await c.close()

        return asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        stop_serve(proc)


def _next_turn(reply: str) -> list[dict]:
    return [*FIRST_TURN, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]


def _computed(model: Path, messages: list[dict]) -> list[int]:
    """The reply's ids, computed by the local engine from nothing."""
    from edgelite import manifest as mf
    from edgelite.client.local import LocalBackend
    from edgelite.reply.generate import generate
    from edgelite.reply.tokenizer import Tokenizer

    m = mf.load(model)

    async def run() -> list[int]:
        backend = LocalBackend(m)
        try:
            return [p.token_id async for p in generate(backend, Tokenizer(m).chat_prompt(messages),
                                                       GenerationConfig(max_tokens=12), reuse=False)
                    if p.token_id is not None]
        finally:
            await backend.close()

    return asyncio.run(run())


def test_a_request_reuses_the_stored_kv_of_an_earlier_ones_prompt(exported, node_factory,
                                                                   tmp_path: Path) -> None:
    """A conversation's next turn through the gateway imports the KV of the turn before (stored
    when that request finished) instead of computing it (reuse_prefixes), with the ids of
    computing it all; a request that shares nothing reuses nothing."""
    from edgelite import manifest as mf
    from edgelite.reply.tokenizer import Tokenizer

    model = exported["llama"]
    (_, _, reused0), (_, ids, reused1), (_, _, reused2) = _three_turns(
        model, [node_factory() for _ in range(2)], tmp_path)
    prompt1 = Tokenizer(mf.load(model)).chat_prompt(FIRST_TURN)
    assert reused0 == 0 and reused1 - reused0 >= len(prompt1) // 16 * 16 - 16 > 0, (reused0, reused1)
    assert reused2 == reused1  # (its prompt shares less than a block with the others)
    reply = Tokenizer(mf.load(model)).decode(_computed(model, FIRST_TURN))
    assert ids == _computed(model, _next_turn(reply))


def test_a_stored_prefix_that_fails_its_checks_when_read_is_computed(exported, node_factory,
                                                                     tmp_path: Path) -> None:
    """The nodes' index finds a conversation's stored KV, but the files were damaged since:
    the next turn's first step fails on it (the nodes read the entries after answering), the
    gateway computes the request instead (its ids are those of computing it), the damaged
    entries are gone, and the gateway goes on serving."""
    import time

    nodes = [node_factory() for _ in range(2)]
    damaged: list[Path] = []

    def entries() -> list[Path]:
        return [p for n in nodes for p in (n.data_dir / "kv").glob("*.kv")]

    def damage() -> None:
        deadline = time.monotonic() + 20  # (the nodes write the first turn's KV behind)
        while len(entries()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(entries()) == 2
        for path in entries():  # bytes in the KV section flipped: the index still finds it
            data = bytearray(path.read_bytes())
            data[-64:-48] = bytes(b ^ 0xFF for b in data[-64:-48])
            path.write_bytes(bytes(data))
            damaged.append(path)

    model = exported["llama"]
    (text1, _, reused0), (_, ids, reused1), (_, ids3, reused2) = _three_turns(
        model, nodes, tmp_path, damage)
    assert reused0 == reused1 == reused2 == 0  # the reuse that failed is not counted
    assert ids == _computed(model, _next_turn(text1)) and ids3
    assert damaged and not any(p.exists() for p in damaged)  # read, failed, deleted
