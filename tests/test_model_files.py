"""Bad model folders: each gives one clear error naming the file, exit 1, no traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli
from edgelite import manifest as mf
from edgelite.errors import ManifestError

pytestmark = pytest.mark.engine


@pytest.fixture
def model_copy(exported: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(exported["llama"], tmp_path / "m"))


def _generate(model: Path):
    return run_cli("generate", "--model", str(model), "--max-tokens", "2", "hi")


def _assert_clean_error(res, *needles: str) -> None:
    assert res.returncode == 1, res.stdout
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr


def test_missing_file(model_copy: Path) -> None:
    (model_copy / "layer_001.onnx").unlink()
    _assert_clean_error(_generate(model_copy), "layer_001.onnx", "missing")


def test_renamed_file(model_copy: Path) -> None:
    (model_copy / "head.onnx").rename(model_copy / "head2.onnx")
    _assert_clean_error(_generate(model_copy), "head.onnx", "missing")


def test_sha256_mismatch(model_copy: Path) -> None:
    p = model_copy / "layer_000.onnx"
    data = bytearray(p.read_bytes())
    data[-10] ^= 0xFF
    p.write_bytes(bytes(data))
    _assert_clean_error(_generate(model_copy), "layer_000.onnx", "sha256")


def test_truncated_file(model_copy: Path) -> None:
    p = model_copy / "embed.onnx"
    p.write_bytes(p.read_bytes()[:100])
    _assert_clean_error(_generate(model_copy), "embed.onnx", "truncated")


def test_truncated_file_with_matching_manifest(model_copy: Path) -> None:
    """Even if the manifest is edited to match, the refusal names the file."""
    p = model_copy / "layer_002.onnx"
    p.write_bytes(p.read_bytes()[:200])
    raw = json.loads((model_copy / "manifest.json").read_text())
    raw["layers"][2].update(bytes=200, sha256=mf.sha256_file(p))
    raw["fingerprint"] = _fingerprint(raw)
    (model_copy / "manifest.json").write_text(json.dumps(raw))
    _assert_clean_error(_generate(model_copy), "layer_002.onnx", "not a valid ONNX model")


def _fingerprint(raw: dict) -> str:
    entries = [raw["embed"], *raw["layers"], raw["head"]]
    return mf.fingerprint_of([s for e in entries for s in (e["sha256"], *(d["sha256"] for d in e["data"]))])


def test_missing_data_file(model_copy: Path) -> None:
    (model_copy / "layer_001.onnx.data").unlink()
    _assert_clean_error(_generate(model_copy), "layer_001.onnx.data", "missing")


def test_corrupt_data_file(model_copy: Path) -> None:
    p = model_copy / "embed_head.data"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    _assert_clean_error(_generate(model_copy), "embed_head.data", "sha256")


def test_unknown_format(model_copy: Path) -> None:
    raw = json.loads((model_copy / "manifest.json").read_text())
    raw["format"] = "edgelite-model/99"
    (model_copy / "manifest.json").write_text(json.dumps(raw))
    _assert_clean_error(_generate(model_copy), "manifest format", "edgelite-model/99")


def test_no_manifest(tmp_path: Path) -> None:
    _assert_clean_error(_generate(tmp_path), "no manifest")


def test_manifest_validation_errors(model_copy: Path) -> None:
    raw = json.loads((model_copy / "manifest.json").read_text())
    with pytest.raises(ManifestError, match="missing fields hidden_size"):
        mf.parse({k: v for k, v in raw.items() if k != "hidden_size"}, model_copy)
    with pytest.raises(ManifestError, match="fingerprint"):
        mf.parse({**raw, "fingerprint": "0" * 32}, model_copy)
    with pytest.raises(ManifestError, match="num_layers is 9"):
        mf.parse({**raw, "num_layers": 9}, model_copy)
    bad = json.loads(json.dumps(raw))
    bad["layers"][0]["file"] = "../../etc/passwd"
    with pytest.raises(ManifestError, match="plain name"):
        mf.parse(bad, model_copy)
    (model_copy / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not readable JSON"):
        mf.load(model_copy)


@pytest.mark.parametrize("where", ["../canary.bin", "ABSOLUTE"])
def test_weights_named_outside_the_folder_are_refused_unread(model_copy: Path, where: str) -> None:
    """A graph whose initializer's external data names a file outside its folder (a relative
    path up, or an absolute one), with the manifest's hashes made to match: refused with one
    line naming it, and the outside file is never read (its access time, set in the past, stays)."""
    import os

    import onnx

    canary = model_copy.parent / "canary.bin"
    canary.write_bytes(b"\x01" * (1 << 20))
    os.utime(canary, (946684800, canary.stat().st_mtime))  # (2000-01-01: relatime updates it on a read)
    location = str(canary) if where == "ABSOLUTE" else where
    path = model_copy / "layer_001.onnx"
    model = onnx.load(str(path), load_external_data=False)
    victim = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    for entry in victim.external_data:
        if entry.key == "location":
            entry.value = location
        elif entry.key == "offset":
            entry.value = "0"
    path.write_bytes(model.SerializeToString())
    data = json.loads((model_copy / mf.MANIFEST_NAME).read_text())
    layer = data["layers"][1]
    layer["sha256"], layer["bytes"] = mf.sha256_file(path), path.stat().st_size
    entries = [data["embed"], *data["layers"], data["head"]]
    data["fingerprint"] = mf.fingerprint_of([s for e in entries
                                             for s in (e["sha256"], *(d["sha256"] for d in e["data"]))])
    (model_copy / mf.MANIFEST_NAME).write_text(json.dumps(data))
    res = _generate(model_copy)
    _assert_clean_error(res, "which its manifest does not list")
    assert canary.stat().st_atime == 946684800, "the outside file was read"
