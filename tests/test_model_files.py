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
