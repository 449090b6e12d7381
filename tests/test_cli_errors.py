"""Rough edges a new user hits: one-line errors, no tracebacks (CLI in a subprocess)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from edgelite.cli.localnodes import TOKEN
from edgelite.reply.jsonprefix import JsonPrefix
from edgelite.reply.jsonschema import fits
from models import as_if_large

pytestmark = pytest.mark.e2e


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgelite", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_bad_and_busy_ports_are_one_line_errors() -> None:
    for cmd in (("node", "--token", "x" * 32), ("serve", "--model", "m", "--users", "u.json")):
        res = _cli(*cmd, "--port", "70000")
        assert res.returncode == 2 and "'70000' is not a port number" in res.stderr, res.stderr
    res = _cli("serve", "--model", "m", "--http", "127.0.0.1:http", "--no-native")
    assert res.returncode == 2 and "'http' is not a port number" in res.stderr, res.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = _cli("node", "--host", "127.0.0.1", "--port", str(port), "--token", "x" * 32)
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip() == (f"error: cannot listen on 127.0.0.1:{port}: the port is in use "
                                  "(another node or program has it; pick another port with "
                                  "--port, or 0 for any free one)")


def test_version() -> None:
    res = _cli("--version")
    assert res.returncode == 0 and res.stdout.startswith("edgelite ")


def _cluster(tmp_path, node_memory: int, latency_ms: float) -> str:
    spec = {"client": "me", "devices": [{"name": "me", "flops": 5e10, "memory_bytes": 4 << 30},
                                        {"name": "far", "flops": 1e10, "memory_bytes": node_memory}],
            "links": [{"src": a, "dst": b, "latency_ms": latency_ms, "bandwidth_mbps": 50}
                      for a, b in (("me", "far"), ("far", "me"))]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec))
    return str(path)


def test_a_plan_that_keeps_every_layer_on_the_client_says_why(exported, tmp_path) -> None:
    model = str(exported["llama"])
    res = _cli("plan", "--model", model, "--cluster", _cluster(tmp_path, 4 << 30, 40.0), "--json")
    out = json.loads(res.stdout)
    assert [s["addr"] for s in out["stages"]] == [None]
    alone, other = out["expected_ms_per_token"], out["with_nodes_ms_per_token"]
    assert other > alone + 40  # a layer on the far node costs at least the hop there and back
    res = _cli("plan", "--model", model, "--cluster", _cluster(tmp_path, 4 << 30, 40.0))
    text = " ".join(res.stdout.split())
    assert res.returncode == 0 and "Traceback" not in res.stdout + res.stderr
    assert (f"the plan runs every layer on this device: predicted {alone:.2f} ms/token alone vs "
            f"{other:.2f} ms/token at best with the nodes") in text, text
    res = _cli("plan", "--model", model, "--cluster", _cluster(tmp_path, 1 << 10, 0.1))
    assert "no node can hold a layer" in " ".join(res.stdout.split()), res.stdout


def test_unreachable_nodes_are_named_with_the_reason(exported, netns) -> None:
    """Refused, timed out (SYNs sent to a MAC address nobody has) and no route: each node is one
    line with its reason, the plan goes on without it, no traceback."""
    ns = netns("c")
    ip = ["ip", "-n", ns]
    for cmd in (["link", "add", "va", "type", "veth", "peer", "name", "vb"],
                ["addr", "add", "10.9.0.1/24", "dev", "va"], ["link", "set", "va", "up"],
                ["link", "set", "vb", "up"],
                ["neigh", "add", "10.9.0.2", "lladdr", "02:00:00:00:00:99", "dev", "va",
                 "nud", "permanent"]):
        subprocess.run([*ip, *cmd], check=True)
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "edgelite", "generate",
           "--model", str(exported["llama"]), "--max-tokens", "4", "--token", "t" * 32,
           "--nodes", "127.0.0.1:1,10.9.0.2:7070,10.1.2.3:7070", "hello"]
    # nodes asked for and none usable: an error, unless --allow-local
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    err = res.stderr.strip()
    assert res.returncode == 1 and err.count("\n") == 0, err
    assert err.startswith("error: no node could be used (") and err.endswith(
        "--allow-local runs on this device alone") and "connection refused" in err, err
    res = subprocess.run([*cmd, "--allow-local"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    err = " ".join(res.stderr.split())
    assert "Traceback" not in res.stderr
    assert ("left out of the plan: node 127.0.0.1:1: cannot connect: connection refused (nothing "
            "listens on that port: is it running there?)") in err, err
    assert "left out of the plan: node 10.9.0.2:7070: cannot connect: no answer within 2 s" in err
    assert "left out of the plan: node 10.1.2.3:7070: cannot connect: network is unreachable" in err
    assert "no node could be reached: every layer runs on this device" in err


def test_the_plan_shows_each_node_by_its_name(exported, node_factory, tmp_path) -> None:
    node = node_factory(name="kitchen-phone")
    model = as_if_large(exported["llama"], tmp_path / "big")  # the client: room for one layer
    res = _cli("generate", "--model", str(model), "--nodes", node.addr, "--token",
               TOKEN, "--max-tokens", "2", "--client-memory-mb", "2000", "hi")
    assert res.returncode == 0, res.stderr
    assert "│ kitchen-phone " in res.stderr and "(127.0.0.1:" in res.stderr, res.stderr


def test_help_shows_defaults_and_verbose_goes_anywhere(exported) -> None:
    for cmd, default in (("generate", "(default: 128)"), ("node", "(default: 7070)"),
                         ("chat", "(default: 7079)"), ("serve", "(default: 7080)"),
                         ("push", "--to HOST:PORT")):
        res = _cli(cmd, "--help")
        assert res.returncode == 0 and default in " ".join(res.stdout.split()), (cmd, res.stdout)
    model = str(exported["llama"])
    for args in (("-v", "generate", "--model", model, "--max-tokens", "2", "hi"),
                 ("generate", "-v", "--model", model, "--max-tokens", "2", "hi"),
                 ("generate", "--model", model, "--max-tokens", "2", "hi", "-vv")):
        res = _cli(*args)
        assert res.returncode == 0 and " INFO edgelite.client.llm: ready: " in res.stderr, \
            (args, res.stderr[-500:])


def test_new_user_slips_are_one_line_errors(exported, tmp_path) -> None:
    """--threads 0, a node's --data-dir it cannot write, an empty raw prompt, --nodes
    without a token, --kv-dtype float16 with --no-invariant, an unknown KV dtype, int8 without
    the attention kernel: each a one-line error naming what to change, no traceback."""
    model = str(exported["llama"])
    cases = [(("generate", "--model", model, "--threads", "0", "hi"), 2,
              "'0' is not a thread count (1 or more)"),
             (("node", "--token", "x" * 32, "--port", "0", "--data-dir", "/proc/nope"), 1,
              "--data-dir /proc/nope: cannot write there"),
             (("generate", "--model", model, "--raw", ""), 1, "the prompt is empty"),
             (("generate", "--model", model, "--nodes", "127.0.0.1:9", "hi"), 1,
              "the cluster token is needed: --token or EDGELITE_TOKEN"),
             (("generate", "--model", model, "--kv-dtype", "float16", "--no-invariant", "hi"), 1,
              "--kv-dtype float16 needs the invariant attention: drop --no-invariant"),
             (("node", "--token", "x" * 32, "--port", "0", "--kv-dtype", "float16", "--no-invariant"),
              1, "--kv-dtype float16 needs the invariant attention: drop --no-invariant"),
             (("generate", "--model", model, "--kv-dtype", "int3", "hi"), 2,
              "argument --kv-dtype: invalid choice: 'int3'"),
             (("generate", "--model", model, "--kv-dtype", "int8", "--no-attention-kernel", "hi"), 1,
              "an int8 KV needs the attention kernel")]
    for args, code, words in cases:
        res = _cli(*args)
        err = res.stderr.strip()
        last = err.splitlines()[-1] if err else ""  # (argparse prints its usage first)
        assert res.returncode == code and words in last, (args, res.returncode, err)
        assert "Traceback" not in err and (code == 2 or err.count("\n") == 0), err


def test_options_out_of_range_and_cut_replies_are_said(exported, ggufs, tmp_path) -> None:
    """A negative temperature, serve's max_tokens 0 (before anything listens), --quantize
    that would not change a GGUF's blocks: one-line errors; a reply cut at --max-tokens says
    so on stderr (stdout keeps the reply alone)."""
    model = str(exported["llama"])
    for args, words in ((("generate", "--model", model, "--temperature", "-1", "hi"),
                         "temperature must be 0 (greedy) or more (got -1)"),
                        (("generate", "--model", model, "--top-p", "0", "hi"),
                         "top_p must be within 0 (excluded) and 1"),
                        (("serve", "--model", model, "--max-tokens", "0", "--http", "127.0.0.1:0",
                          "--no-native"), "max_tokens must be at least 1 (got 0)")):
        res = _cli(*args)
        err = res.stderr.strip()
        assert res.returncode == 1 and err.startswith(f"error: {words}"), (args, err)
        assert err.count("\n") == 0
        assert "listening" not in res.stdout
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                  "required": ["n"]}))
    alone = _cli("generate", "--model", model, "--json-schema", str(schema), "hi")
    assert alone.returncode == 1 and "--json-schema FILE and --response-format json_schema go " \
        "together" in alone.stderr
    shaped = _cli("generate", "--model", model, "--response-format", "json_schema",
                  "--json-schema", str(schema), "--max-tokens", "24", "--json", "hi")
    assert shaped.returncode == 0, shaped.stderr
    text = json.loads(shaped.stdout)["text"]
    assert JsonPrefix().feed(text) and fits(json.loads(schema.read_text()), text), text
    cut = _cli("generate", "--model", model, "--max-tokens", "3", "hi")
    assert cut.returncode == 0 and "[cut at --max-tokens 3: raise it" in cut.stderr
    assert "cut at" not in cut.stdout
    export = subprocess.run([sys.executable, "-m", "edgelite_export", str(ggufs["Q4_1"]), "--out",
                             str(tmp_path / "x"), "--quantize", "int8"], capture_output=True,
                            text=True, timeout=120)
    assert export.returncode == 1 and export.stderr.strip().count("\n") == 0, export.stderr
    assert "--quantize int8: this GGUF's weights are 4-bit" in export.stderr
    assert not (tmp_path / "x").exists()


def test_probe_is_json_and_local_without_nodes(exported, node_factory) -> None:
    """probe --json is JSON (no NaN: a figure not measured is null); without --nodes it
    probes this device alone and says how to find nodes; a node with another token is named
    once with the reason."""
    node = node_factory()
    model = exported["llama"]
    res = _cli("probe", "--nodes", node.addr, "--token", TOKEN, "--json")
    out = json.loads(res.stdout, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    assert [r["src"] for r in out["links"]] == ["client", node.addr]
    assert all("bandwidth_back_mbps" not in r and r["bandwidth_mbps"] > 0 for r in out["links"])
    alone = _cli("probe", "--json")
    assert alone.returncode == 0 and "no --nodes: this device alone" in alone.stderr
    # a node with another token: named once, with the reason, and an error (no --allow-local)
    wrong = _cli("generate", "--model", str(model), "--nodes", node.addr, "--token", "WRONG",
                 "--max-tokens", "2", "hi")
    assert wrong.returncode == 1 and wrong.stderr.strip() == (
        f"error: no node could be used (node {node.addr}: wrong token); --allow-local runs on "
        f"this device alone"), wrong.stderr
    assert [d["name"] for d in json.loads(alone.stdout)["devices"]] == ["client"]
    text = _cli("probe")  # (no empty matrices, no "0.0 GFLOP/s" for a speed not measured)
    assert text.returncode == 0 and "no links: one device" in text.stdout, text.stdout
    assert "GFLOP/s" not in text.stdout and "speed not measured" in text.stdout, text.stdout


def test_a_what_if_plan_over_cluster_json_says_what_its_table_shows(smollm2_int4) -> None:
    """cluster.json devices have no address: a plan that gives them layers is still a split
    (the table and the words agree), and the summary says what QoS and complexity are."""
    res = _cli("plan", "--model", str(smollm2_int4), "--cluster", "examples/phones.json")
    assert "│ 2 " in res.stdout, res.stdout  # (a split: SmolLM2 does not fit on one phone)
    text = " ".join(res.stdout.split())
    assert res.returncode == 0, res.stderr
    assert "every layer on this device" not in text, text
    assert "not time" in text and "QoS" in text, text
    # (written to a pipe: each row of the table on one line, not cut at 80 columns)
    assert any("hop in ms" in line and "predicted" in line for line in res.stdout.splitlines()), res.stdout


def test_budgets_that_cannot_work_and_flags_that_would_be_ignored_are_said(exported, tmp_path) -> None:
    """--memory-mb -5 or 10 (below what the node process holds already) and --draft-tokens
    without --speculate used to be taken without a word (then every load refused, or nothing
    drafted): each is now a one-line error before anything starts."""
    for value, words in (("-5", "'-5' is not a memory budget in MiB"),
                         ("10", "--memory-mb 10: this node process holds")):
        res = _cli("node", f"--memory-mb={value}", "--port", "0", "--data-dir", str(tmp_path / "n"))
        last = res.stderr.strip().splitlines()[-1]  # (argparse's usage comes before its error)
        assert res.returncode != 0 and words in last, res.stderr
        assert "listening" not in res.stdout
    res = _cli("generate", "--model", str(exported["llama"]), f"--client-memory-mb={-1}", "hi")
    assert res.returncode != 0 and "not a memory budget in MiB" in res.stderr
    res = _cli("generate", "--model", str(exported["llama"]), "--draft-tokens", "4", "hi")
    assert res.returncode == 1 and res.stderr.strip() == (
        "error: --draft-tokens goes with --speculate lookup or --speculate DIR (without them nothing "
        "is drafted)"), res.stderr
