"""`edgelite serve`: 8 concurrent clients on a 2-node cluster whose KV budget forces preemption."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN, start_serve
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
    nodes = [node_factory(kv_budget_mb=0.02, extra=("--kv-buckets", "16,32,48,64,128,256"))
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
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
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
    assert '"tiers"' in chat.stdout


def test_a_request_reuses_the_stored_kv_of_an_earlier_ones_prompt(exported, node_factory,
                                                                   tmp_path: Path) -> None:
    """A conversation's next turn through the gateway imports the KV of the turn before (stored
    when that request finished) instead of computing it (reuse_prefixes), with the ids of
    computing it all; a request that shares nothing reuses nothing."""
    from edgelite import manifest as mf
    from edgelite.engine.generate import LocalBackend, generate
    from edgelite.engine.tokenizer import Tokenizer

    model = exported["llama"]
    nodes = [node_factory() for _ in range(2)]
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"users": USERS}))
    first = [{"role": "user", "content": " ".join(f"word{i}" for i in range(40))}]
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
                one = await ask(c, first)
                two = await ask(c, [*first, {"role": "assistant", "content": one[0]},
                                    {"role": "user", "content": "and then?"}])
                three = await ask(c, [{"role": "user", "content": "something else"}])
                return [one, two, three]
            finally:
                await c.close()

        (_, _, reused0), (_, ids, reused1), (_, _, reused2) = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    m = mf.load(model)
    tok = Tokenizer(m)
    prompt1 = tok.chat_prompt(first)
    assert reused0 == 0 and reused1 - reused0 >= len(prompt1) // 16 * 16 - 16 > 0, (reused0, reused1)
    assert reused2 == reused1  # (its prompt shares less than a block with the others)

    async def computed() -> list[int]:
        backend = LocalBackend(m)
        try:
            reply = await backend_reply(backend, prompt1)
            prompt2 = tok.chat_prompt([*first, {"role": "assistant", "content": tok.decode(reply)},
                                       {"role": "user", "content": "and then?"}])
            return await backend_reply(backend, prompt2)
        finally:
            await backend.close()

    async def backend_reply(backend, prompt: list[int]) -> list[int]:
        return [t async for t in generate(backend, prompt, GenerationConfig(max_tokens=12), reuse=False)]

    assert ids == asyncio.run(computed())


def test_a_stored_prefix_that_fails_its_checks_when_read_is_computed(exported, node_factory,
                                                                     tmp_path: Path) -> None:
    """The nodes' index finds a conversation's stored KV, but the files were damaged since:
    the next turn's first step fails on it (the nodes read the entries after answering), the
    gateway computes the request instead (its ids are those of computing it), the damaged
    entries are gone, and the gateway goes on serving."""
    import time

    from edgelite import manifest as mf
    from edgelite.engine.generate import LocalBackend, generate
    from edgelite.engine.tokenizer import Tokenizer

    model = exported["llama"]
    nodes = [node_factory() for _ in range(2)]
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"users": USERS}))
    first = [{"role": "user", "content": " ".join(f"word{i}" for i in range(40))}]

    def entries() -> list[Path]:
        return [p for n in nodes for p in (n.data_dir / "kv").glob("*.kv")]

    def written(n: int) -> list[Path]:
        deadline = time.monotonic() + 20
        while len(entries()) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return entries()

    damaged: list[Path] = []

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
                one = await ask(c, first)
                assert len(await asyncio.to_thread(written, 2)) == 2  # (the nodes write behind)
                for path in entries():  # bytes in the KV section flipped: the index still finds it
                    data = bytearray(path.read_bytes())
                    data[-64:-48] = bytes(b ^ 0xFF for b in data[-64:-48])
                    path.write_bytes(bytes(data))
                    damaged.append(path)
                two = await ask(c, [*first, {"role": "assistant", "content": one[0]},
                                    {"role": "user", "content": "and then?"}])
                three = await ask(c, [{"role": "user", "content": "something else"}])
                return [one, two, three]
            finally:
                await c.close()

        (text1, _, reused0), (_, ids, reused1), (_, ids3, reused2) = asyncio.run(
            asyncio.wait_for(main(), 120))
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert reused0 == reused1 == reused2 == 0  # the reuse that failed is not counted
    m = mf.load(model)
    tok = Tokenizer(m)

    async def computed(prompt: list[int]) -> list[int]:
        backend = LocalBackend(m)
        try:
            return [t async for t in generate(backend, prompt, GenerationConfig(max_tokens=12), reuse=False)]
        finally:
            await backend.close()

    prompt2 = tok.chat_prompt([*first, {"role": "assistant", "content": text1},
                               {"role": "user", "content": "and then?"}])
    assert ids == asyncio.run(computed(prompt2)) and ids3
    assert damaged and not any(p.exists() for p in damaged)  # read, failed, deleted
