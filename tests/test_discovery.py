"""`--nodes auto`: nodes answer a UDP broadcast question made with their cluster token; a
neighbour's nodes (another token) are ignored. On loopback and between network namespaces."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN
from edgelite.config import DiscoveryConfig
from edgelite.ids import NodeAddr
from edgelite.net import discovery as d

pytestmark = pytest.mark.e2e
NONCE = "ab" * 16


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_only_questions_and_answers_made_with_the_token_count() -> None:
    ask = d.question(TOKEN, NONCE)
    reply = d.answer_for(TOKEN, ask, 7070, None, "phone")
    assert reply is not None
    assert d.found_in(TOKEN, NONCE, reply, "10.0.0.5") == d.Found(NodeAddr("10.0.0.5", 7070), "phone")
    assert d.answer_for("another-token", ask, 7070, None, "phone") is None  # a neighbour's node
    assert d.found_in("another-token", NONCE, reply, "10.0.0.5") is None  # a neighbour's client
    assert d.found_in(TOKEN, "cd" * 16, reply, "10.0.0.5") is None  # an answer to an old question
    for key, value in (("port", 7071), ("host", "10.9.9.9"), ("name", "evil"), ("mac", "00")):
        forged = json.dumps({**json.loads(reply), key: value}).encode()
        assert d.found_in(TOKEN, NONCE, forged, "10.0.0.5") is None, key
    for junk in (b"", b"\xff" * 10, b"[]", b"{}", json.dumps({"v": 1}).encode(), ask * 20,
                 json.dumps({**json.loads(reply), "port": 70000}).encode()):
        assert d.answer_for(TOKEN, junk, 7070, None, "x") is None
        assert d.found_in(TOKEN, NONCE, junk, "10.0.0.5") is None
    listening = d.answer_for(TOKEN, ask, 7070, "192.168.1.9", "phone")
    assert listening is not None  # a node bound to one address names it
    assert d.found_in(TOKEN, NONCE, listening, "10.0.0.5").addr == NodeAddr("192.168.1.9", 7070)


def test_nodes_auto_finds_three_nodes_and_generates_like_the_list(exported, node_factory) -> None:
    port = _free_udp_port()
    flags = ("--discovery-port", str(port))
    nodes = [node_factory(extra=flags) for _ in range(3)]
    node_factory(extra=flags, token="a-neighbours-token")  # answers only its own cluster
    cfg = DiscoveryConfig(port=port, broadcast=("127.255.255.255",))
    t0 = time.monotonic()
    found = asyncio.run(d.discover(TOKEN, cfg))
    assert time.monotonic() - t0 < 2.0
    assert sorted(str(f.addr) for f in found) == sorted(n.addr for n in nodes)
    model, split = str(exported["llama"]), "0-0,1-1,2-2"
    common = ("generate", "--model", model, "--json", "--max-tokens", "8", "--token", TOKEN,
              "--split", split, "hello there")
    listed = json.loads(run_cli(*common, "--nodes", ",".join(str(f.addr) for f in found)).stdout)
    auto = json.loads(run_cli(*common, "--nodes", "auto", "--broadcast", "127.255.255.255",
                              *flags).stdout)
    assert auto["token_ids"] == listed["token_ids"] and auto["plan"] == listed["plan"]
    # with no node of this cluster there: one line, no traceback
    res = subprocess.run([sys.executable, "-m", "edgelite", "generate", "--model", model, "--nodes",
                          "auto", "--broadcast", "127.255.255.255", "--discovery-port",
                          str(_free_udp_port()), "--token", TOKEN, "hi"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 1 and res.stderr.startswith("error: no node answered within 1.5 s"), \
        res.stderr


def test_discovery_across_network_namespaces(exported, node_factory, netns) -> None:
    """A client namespace and a node namespace joined by a veth pair (a LAN): the client finds
    the nodes by the default broadcast (255.255.255.255) and runs the model on them."""
    client, phones = netns("cli"), netns("phn")
    subprocess.run(["ip", "link", "add", "vcli", "netns", client, "type", "veth", "peer", "name",
                    "vphn", "netns", phones], check=True)
    for ns, dev, addr in ((client, "vcli", "10.77.0.1/24"), (phones, "vphn", "10.77.0.2/24")):
        subprocess.run(["ip", "-n", ns, "addr", "add", addr, "dev", dev], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True)
        subprocess.run(["ip", "-n", ns, "route", "add", "default", "dev", dev], check=True)
    wrap = ("ip", "netns", "exec", phones)
    nodes = [node_factory(host="0.0.0.0", wrap=wrap) for _ in range(3)]
    node_factory(host="0.0.0.0", wrap=wrap, token="a-neighbours-token")
    in_client = ["ip", "netns", "exec", client, sys.executable]
    res = subprocess.run([*in_client, "-c", "import asyncio, edgelite; print(sorted(str(f.addr) "
                          f"for f in asyncio.run(edgelite.discover({TOKEN!r}))))"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert eval(res.stdout) == sorted(f"10.77.0.2:{n.port}" for n in nodes)
    env = {**os.environ, "EDGELITE_TOKEN": TOKEN}
    auto = subprocess.run([*in_client, "-m", "edgelite", "generate", "--model", str(exported["llama"]),
                           "--nodes", "auto", "--split", "0-0,1-1,2-2", "--json", "--max-tokens",
                           "8", "hello there"], capture_output=True, text=True, timeout=120, env=env)
    assert auto.returncode == 0, auto.stderr
    local = json.loads(run_cli("generate", "--model", str(exported["llama"]), "--json",
                               "--max-tokens", "8", "hello there").stdout)
    assert json.loads(auto.stdout)["token_ids"] == local["token_ids"]
    # a node listening on every address prints the one its LAN reaches it at
    lone = node_factory(host="0.0.0.0", wrap=wrap, extra=("--discovery-port", "0"))
    assert lone.banner.endswith(f"listening on 0.0.0.0:{lone.port} (on the LAN: "
                                f"10.77.0.2:{lone.port})"), lone.banner
