"""Orchestrate one export: load, trace every piece, (quantize), verify, then publish atomically.

Everything is written into a temporary sibling folder and renamed onto --out at the end, so a
failure never leaves a half-written model folder, and a failed verification writes no manifest.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgelite import manifest as mf
from edgelite.errors import EdgeliteError
from edgelite_export import export, quantize, source
from edgelite_export.verify import Report, verify

log = logging.getLogger(__name__)
VERIFY_MESSAGE = "Explain in one sentence why the sky is blue."
Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass
class Options:
    quantize: str | None = None
    steps: int = 32
    prompt: str = VERIFY_MESSAGE
    force: bool = False


@dataclass
class Result:
    out: Path
    manifest: mf.Manifest
    report: Report
    rows: list[dict[str, Any]] = field(default_factory=list)  # file, mb, seconds, diff
    load_seconds: float = 0.0


def prompt_ids(tok: Any, text: str) -> list[int]:
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(i) for i in ids]
    return [int(i) for i in tok(text)["input_ids"]]


def eos_ids(model: Any, tok: Any) -> list[int]:
    found: set[int] = set()
    for src in (model.config, getattr(model, "generation_config", None), tok):
        val = getattr(src, "eos_token_id", None)
        found.update([val] if isinstance(val, int) else list(val or []))
    return sorted(found)


def entry(out: Path, ex: export.Exported, cfg: Any) -> mf.FileEntry:
    path = out / ex.file
    h = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    is_layer = ex.kind == "layer"
    return mf.FileEntry(
        file=ex.file, sha256=mf.sha256_file(path), bytes=path.stat().st_size,
        param_bytes=ex.param_count * 4, flops_per_token=2 * ex.matmul_params,
        activation_bytes_per_token=h * 4,
        kv_bytes_per_token=2 * cfg.num_key_value_heads * head_dim * 4 if is_layer else 0)


def make_manifest(out: Path, name: str, model: Any, tok: Any, pieces: list[export.Exported],
                  quant: dict[str, Any] | None) -> mf.Manifest:
    cfg = model.config
    entries = [entry(out, ex, cfg) for ex in pieces]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return mf.Manifest(
        name=name, architecture=cfg.model_type, dtype="float32", hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, vocab_size=cfg.vocab_size,
        max_positions=cfg.max_position_embeddings, rope=source.rope_parameters(cfg),
        eos_token_ids=eos_ids(model, tok), chat_template=getattr(tok, "chat_template", None),
        tokenizer="tokenizer.json", embed=entries[0], head=entries[-1], layers=entries[1:-1],
        fingerprint=mf.fingerprint_of([e.sha256 for e in entries]), quantization=quant,
        special_tokens={k: getattr(tok, k, None) for k in ("bos_token", "eos_token")},
        root=out)


def _trace_all(model: Any, out: Path, progress: Progress) -> list[export.Exported]:
    n = model.config.num_hidden_layers
    total = n + 2
    pieces = [export.export_embed(model, out)]
    progress("embed.onnx", 1, total)
    for j in range(n):
        pieces.append(export.export_layer(model, j, out))
        progress(pieces[-1].file, j + 2, total)
    pieces.append(export.export_head(model, out))
    progress("head.onnx", total, total)
    return pieces


def _publish(tmp: Path, out: Path, force: bool) -> None:
    if out.exists():
        if not force:
            raise EdgeliteError(f"{out} exists; pass --force to replace it")
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)


def _check_out(out: Path, opts: Options) -> None:
    if out.exists() and not opts.force:
        raise EdgeliteError(f"{out} exists; pass --force to replace it")
    if opts.quantize and opts.quantize not in quantize.METHODS:
        raise EdgeliteError(f"--quantize {opts.quantize!r}: known methods {quantize.METHODS}")


def run(src_text: str, out: Path, opts: Options, progress: Progress | None = None) -> Result:
    """Export SOURCE (folder, .gguf, hub id or alias) into `out`."""
    _check_out(out.resolve(), opts)
    t0 = time.perf_counter()
    src = source.resolve(src_text)
    model, tok = source.load(src)
    res = run_model(model, tok, src.name, out, opts, progress)
    res.load_seconds = time.perf_counter() - t0
    return res


def run_model(model: Any, tok: Any, name: str, out: Path, opts: Options,
              progress: Progress | None = None) -> Result:
    """Export an already loaded float32 HF model and its tokenizer into `out`."""
    progress = progress or (lambda *_: None)
    out = out.resolve()
    _check_out(out, opts)
    source.check_supported(model.config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        pieces = _trace_all(model, tmp, progress)
        if opts.quantize:
            for ex in pieces[1:]:
                quantize.quantize_file(tmp / ex.file)
        tok.save_pretrained(tmp)
        if not (tmp / "tokenizer.json").is_file():
            raise EdgeliteError(f"{name}: the tokenizer has no fast (tokenizer.json) form")
        quant = quantize.describe(opts.quantize) if opts.quantize else None
        manifest = make_manifest(tmp, name, model, tok, pieces, quant)
        progress("verify", 0, 1)
        report = verify(manifest, model, prompt_ids(tok, opts.prompt), opts.steps,
                        strict=opts.quantize is None)
        manifest = mf.Manifest(**{**manifest.__dict__, "verification": report.to_json()})
        mf.write(manifest, tmp)
        _publish(tmp, out, opts.force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [{"file": ex.file, "mb": e.bytes / 1e6, "seconds": ex.seconds,
             "diff": report.file_diff.get(ex.file, float("nan"))}
            for ex, e in zip(pieces, manifest.files, strict=True)]
    return Result(out, mf.load(out), report, rows)
