"""`edgelite push DIR --to HOST:PORT`: an export reaches a phone's node over the wire, resumes
after a broken transfer, is checked by sha256, and runs from there; bad requests change nothing."""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN
from edgelite.client.push import export_files, push
from edgelite.config import ClientConfig, WireLimits
from edgelite.errors import NodeError
from edgelite.ids import NodeAddr
from edgelite.manifest import sha256_file
from edgelite.net import messages as m
from edgelite.net.link import NodeLink

pytestmark = pytest.mark.e2e


class Broken(Exception):
    pass


def test_push_resumes_and_the_copy_runs(exported, node_factory) -> None:
    model = exported["llama"]
    node = node_factory()
    addr = NodeAddr.parse(node.addr)
    total = sum(f.bytes for f in export_files(model))
    held_at_break = 0

    def break_midway(_what: str, held: int, _total: int) -> None:
        nonlocal held_at_break
        held_at_break = held
        if held > total // 3:
            raise Broken

    with pytest.raises(Broken):  # the link goes down a third of the way in
        asyncio.run(push(model, addr, TOKEN, "tiny", ClientConfig(deploy_chunk_bytes=8192),
                         break_midway))
    assert not (node.data_dir / "models" / "tiny").exists()
    res = run_cli("push", str(model), "--to", node.addr, "--token", TOKEN, "--name", "tiny")
    assert res.returncode == 0, res.stderr
    sent_mb = float(res.stdout.split(" MB sent now")[0].rsplit(", ", 1)[1])
    assert abs(sent_mb * 1e6 - (total - held_at_break)) < 0.06e6  # only the rest went
    kept = node.data_dir / "models" / "tiny"
    assert str(kept.resolve()) in res.stdout
    for f in export_files(model):
        assert sha256_file(kept / f.file) == f.sha256
    assert [p.name for p in (node.data_dir / "models").iterdir()] == ["tiny"]  # nothing staged left
    here = json.loads(run_cli("generate", "--model", str(model), "--json", "--max-tokens", "8",
                              "hello").stdout)
    there = json.loads(run_cli("generate", "--model", str(kept), "--json", "--max-tokens", "8",
                               "hello").stdout)
    assert there["token_ids"] == here["token_ids"]
    # pushed again: nothing to send, the folder replaced whole
    again = run_cli("push", str(model), "--to", node.addr, "--token", TOKEN, "--name", "tiny")
    assert "0.0 MB sent now" in again.stdout
    # another client (its own home, so its own key) cannot replace it; under its own name it can
    other = {"EDGELITE_HOME": str(node.data_dir.parent / "other-home")}
    theirs = run_cli("push", str(model), "--to", node.addr, "--token", TOKEN, "--name", "tiny",
                     env=other)
    assert theirs.returncode == 1 and "pushed by another client" in theirs.stderr, theirs.stderr
    assert theirs.stderr.count("\n") == 1 and "Traceback" not in theirs.stderr
    assert run_cli("push", str(model), "--to", node.addr, "--token", TOKEN, "--name", "tiny2",
                   env=other).returncode == 0
    assert sha256_file(kept / "manifest.json") == files_sha(model)["manifest.json"]


def files_sha(model) -> dict[str, str]:
    return {f.file: f.sha256 for f in export_files(model)}


def test_bad_model_puts_are_refused_and_change_nothing(exported, node_factory) -> None:
    model = exported["llama"]
    node = node_factory()
    files = {f.file: f.sha256 for f in export_files(model)}

    async def main() -> list[str]:
        link = await NodeLink.open(NodeAddr.parse(node.addr), TOKEN, None, WireLimits(), 5)
        errors = []
        try:
            for name, fs in (("../up", files), (".hidden", files), ("a/b", files),
                             ("ok", {"../manifest.json": files["manifest.json"]}),
                             ("ok", {"manifest.json": "0" * 64}),  # no such blob
                             ("ok", {"manifest.json": "not-a-sha"}),
                             ("ok", {k: v for k, v in files.items() if k != "manifest.json"})):
                with pytest.raises(NodeError) as err:
                    await link.request(m.ModelPut(id=0, name=name, files=fs), m.ModelStored, 10)
                errors.append(str(err.value))
            # the manifest alone (its graphs never sent): refused, nothing half made
            from edgelite.net.upload import send_files

            only = [f for f in export_files(model) if f.file == "manifest.json"]
            await send_files(link, model, only, 1 << 20, 10)
            with pytest.raises(NodeError) as err:
                await link.request(m.ModelPut(id=0, name="ok", files={"manifest.json":
                                                                      only[0].sha256}),
                                   m.ModelStored, 10)
            errors.append(str(err.value))
            assert await link.request(m.Ping(id=0), m.Pong, 5)  # the node goes on
        finally:
            await link.close()
        return errors

    errors = asyncio.run(main())
    assert all(e.count("\n") == 0 for e in errors)
    assert "is not a plain name" in errors[0] and "is not a plain name" in errors[3]
    assert "not deployed to this node" in errors[4] and "not a sha256" in errors[5]
    assert "no manifest.json" in errors[6] and "listed in its manifest but was not pushed" in errors[7]
    shelf = node.data_dir / "models"
    assert not shelf.exists() or list(shelf.iterdir()) == []
