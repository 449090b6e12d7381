"""`edgelite models`: the exports this device and its nodes keep are listed, removed (a node's
only by the client that pushed them) and their unused deployed files deleted; the blob store is
a cache that makes room for an upload from files nothing uses, never from those in use."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN
from edgelite.errors import ProtocolError
from edgelite.node.blobs import BlobStore


def _blob(store: BlobStore, data: bytes, age_s: float = 0.0) -> str:
    sha = hashlib.sha256(data).hexdigest()
    store.append(sha, 0, len(data), data)
    if age_s:
        t = time.time() - age_s
        os.utime(store.path(sha), (t, t))
    return sha


@pytest.mark.unit
def test_the_blob_store_makes_room_from_unused_files_only(tmp_path) -> None:
    store = BlobStore(tmp_path, quota_bytes=3000, grace_s=60)
    old = _blob(store, b"a" * 1000, age_s=3600)
    older = _blob(store, b"b" * 1000, age_s=7200)
    pinned = _blob(store, b"c" * 900, age_s=9000)
    store.pinned = lambda: {pinned}
    assert store.figures().unused_files == 2
    # 1000 more bytes: the least recently used unused file goes, nothing else
    new = _blob(store, b"d" * 1000)
    assert not store.has(older) and store.has(old) and store.has(pinned) and store.has(new)
    # a file linked from a model folder counts as used; a recent one is within its grace
    os.link(store.path(old), tmp_path / "linked")
    with pytest.raises(ProtocolError, match="disk quota"):
        _blob(store, b"e" * 1100)
    assert store.has(old) and store.has(new) and store.has(pinned)
    # collect: only unused files idle past the time given
    (tmp_path / "linked").unlink()
    assert store.collect(idle_s=1800) == (1, 1000)
    assert not store.has(old) and store.has(new) and store.has(pinned)
    assert store.collect(idle_s=0) == (1, 1000) and store.has(pinned)


@pytest.mark.e2e
def test_models_lists_removes_and_collects_here(exported, tmp_path) -> None:
    shelf = tmp_path / "data" / "models"
    shelf.mkdir(parents=True)
    shutil.copytree(exported["llama"], shelf / "tiny")
    extra = tmp_path / "more"
    shutil.copytree(exported["llama"], extra / "copy")
    (extra / "notes").mkdir()  # not an export: not listed
    data = ["--data-dir", str(tmp_path / "data")]
    # (run away from the checkout: the demo, run first as the README orders, leaves its export
    # in ./models, which `models` lists too)
    listed = run_cli("models", *data, "--dir", str(extra), "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    found = json.loads(listed.stdout)
    assert sorted(os.path.basename(e["path"]) for e in found["models"]) == ["copy", "tiny"]
    assert all(e["bytes"] > 0 and e["layers"] >= 1 for e in found["models"])
    assert found["blobs"] is None
    text = run_cli("models", *data, "--dir", str(extra), cwd=tmp_path).stdout
    assert "tiny" in text and "copy" in text and "MB" in text
    # rm by name, by folder; a folder that is no export is refused in one line
    assert run_cli("models", "rm", "tiny", *data).returncode == 0
    assert not (shelf / "tiny").exists()
    bad = run_cli("models", "rm", str(extra / "notes"), *data)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "is not an export" in bad.stderr
    assert (extra / "notes").is_dir()
    missing = run_cli("models", "rm", "nope", *data)
    assert missing.returncode == 1 and "no export named nope" in missing.stderr
    assert "Traceback" not in bad.stderr + missing.stderr
    assert run_cli("models", "rm", str(extra / "copy"), *data).returncode == 0
    assert not (extra / "copy").exists()
    # gc here: an old unused blob goes, one a model folder links to stays, and one used within
    # the grace time stays too, and both the listing and gc say so (they said 1 deletable, then
    # gc deleted none)
    store = BlobStore(tmp_path / "data")
    gone, kept = _blob(store, b"x" * 5000, age_s=7200), _blob(store, b"y" * 3000, age_s=7200)
    recent = _blob(store, b"z" * 2000, age_s=10)
    os.link(store.path(kept), tmp_path / "linked")
    listing = run_cli("models", *data, cwd=tmp_path).stdout
    assert "nothing uses 1 (0.0 MB): `edgelite models gc` deletes those; 1 more (0.0 MB) nothing uses " \
           "were used within the last 1 h and are kept until then" in listing, listing
    gc = run_cli("models", "gc", *data, "--json")
    assert json.loads(gc.stdout) == {"deleted_files": 1, "deleted_bytes": 5000, "kept_recent_files": 1}
    assert not store.has(gone) and store.has(kept) and store.has(recent)
    said = run_cli("models", "gc", *data).stdout
    assert "deleted 0 deployed files" in said and "1 more (0.0 MB) nothing uses were used within" in said


@pytest.mark.e2e
def test_models_on_nodes_belong_to_who_pushed_them(exported, node_factory, tmp_path) -> None:
    model = exported["llama"]
    log = tmp_path / "node.log"
    node = node_factory(extra=("--set", "blob_grace_s=0"), log_file=log)
    mine = {"EDGELITE_HOME": str(tmp_path / "me")}
    theirs = {"EDGELITE_HOME": str(tmp_path / "them")}
    for name, env in (("tiny", mine), ("other", theirs)):
        res = run_cli("push", str(model), "--to", node.addr, "--token", TOKEN, "--name", name,
                      env=env)
        assert res.returncode == 0, res.stderr
    on = ["--nodes", node.addr, "--token", TOKEN]
    listed = run_cli("models", *on, "--json", env=mine)
    assert listed.returncode == 0, listed.stderr
    state = json.loads(listed.stdout)["nodes"][0]
    assert {x["name"]: x["yours"] for x in state["models"]} == {"tiny": True, "other": False}
    assert state["blobs"]["files"] >= 3 and state["blobs"]["unused_files"] == 0
    # another client's folder is refused, in one line; the owner removes its own
    refused = run_cli("models", "rm", "other", *on, env=mine)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "pushed by another client" in refused.stderr and "Traceback" not in refused.stderr
    assert (node.data_dir / "models" / "other").is_dir()
    for name in ("../tiny", "a/b", ".hidden", "x" * 65):  # names from the wire are never paths
        bad = run_cli("models", "rm", name, *on, env=mine)
        assert bad.returncode == 1 and bad.stderr.count("\n") == 1, bad.stderr
        assert ("is not a plain name" in bad.stderr or "65 long, the limit is 64" in bad.stderr), \
            bad.stderr
        assert bad.stderr.count(node.addr) == 1, bad.stderr  # (the node named once)
    assert run_cli("models", *on, env=mine).returncode == 0  # the node goes on
    assert run_cli("models", "rm", "tiny", *on, env=mine).returncode == 0
    assert not (node.data_dir / "models" / "tiny").exists()
    # the same files back the other folder: gc deletes nothing until it goes too
    gc = json.loads(run_cli("models", "gc", *on, "--json", env=mine).stdout)
    assert gc["nodes"][0]["deleted_files"] == 0
    assert run_cli("models", "rm", "other", *on, env=theirs).returncode == 0
    gc = json.loads(run_cli("models", "gc", *on, "--json", env=mine).stdout)
    assert gc["nodes"][0]["deleted_files"] == state["blobs"]["files"]
    assert list((node.data_dir / "blobs").iterdir()) == []
    # a headless node says what happens (its stdout is not a terminal)
    said = log.read_text()
    assert "connected from 127.0.0.1" in said and " left" in said and "model other removed" in said
