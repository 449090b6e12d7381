"""Orchestrate one export: load, gather the weights, write every piece, verify, publish.

Everything is written into a temporary sibling folder and renamed onto --out at the end, so a
failure never leaves a half-written model folder, and an export that fails its verification is
not published (unless `accept_drift`, and then the manifest records the measured figures).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgelite import manifest as mf
from edgelite.errors import EdgeliteError
from edgelite_export import graph, reference_text, source, weights
from edgelite_export.blocks import Blocks
from edgelite_export.verify import Report, verify

log = logging.getLogger(__name__)
VERIFY_MESSAGE = "Explain in one sentence why the sky is blue."
VERIFY_TEXT_TOKENS = 768  # of reference_text.py, teacher-forced besides the prompt
Progress = Callable[[str, int, int], None]  # (what, done, total)
QUANTIZE = ("none", "int8", "int4")
MODES = ("exact", "fast")


@dataclass
class Options:
    quantize: str | None = None  # none | int8 | int4; None: as the source (see weights.py)
    mode: str = "fast"  # for block weights: exact (float compute) or fast (int8 activations)
    steps: int = 32  # greedy steps verified beyond the prompt
    prompt: str = VERIFY_MESSAGE
    accept_drift: bool = False  # publish even when verification misses its thresholds
    force: bool = False


@dataclass
class Result:
    out: Path
    manifest: mf.Manifest
    report: Report
    rows: list[dict[str, Any]] = field(default_factory=list)  # file, mb, seconds
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


def _flops(w: Any) -> int:
    """2 FLOPs per weight of a linear layer, per token."""
    return 2 * int(np.prod(w.shape)) if w is not None else 0


def _layer_flops(lw: graph.LayerWeights) -> int:
    return sum(_flops(x.weight) for x in (lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down))


def _entry(out: Path, name: str, param_bytes: int, flops: int, act: int, kv: int,
           data: list[Path]) -> mf.FileEntry:
    p = out / name
    return mf.FileEntry(name, mf.sha256_file(p), p.stat().st_size, param_bytes, flops, act, kv,
                        tuple(mf.DataFile(d.name, mf.sha256_file(d), d.stat().st_size) for d in data))


def write_pieces(w: weights.Weights, compute: str, out: Path, progress: Progress
                 ) -> tuple[mf.FileEntry, list[mf.FileEntry], mf.FileEntry, list[dict[str, Any]],
                            dict[str, Any] | None]:
    """Every graph and data file; also where a fast block head's rows are (exact rescoring)."""
    a = w.arch
    total = len(w.layers) + 2
    shared = graph.DataFile(out / "embed_head.data")  # a tied head reuses the table's bytes
    t0 = time.perf_counter()
    eb = graph.embed(a, w.embed, shared, out / "embed.onnx", graph.halves_head(w.head, compute))
    hb = graph.head(a, w.norm, w.head, compute, shared, out / "head.onnx")
    rows = graph.exact_rows(w.head, shared) if compute == "fast" and isinstance(w.head, Blocks) else None
    shared.close()
    exact_head = rows
    rows = [{"file": "embed.onnx + head.onnx", "seconds": time.perf_counter() - t0}]
    progress("embed.onnx, head.onnx", 2, total)
    act, kv = a.hidden * 4, 2 * a.kv_heads * a.head_dim * 4
    embed = _entry(out, "embed.onnx", eb, 0, act, 0, [shared.path])
    head = _entry(out, "head.onnx", hb, _flops(w.head), act, 0, [shared.path])
    layers = []
    for j, lw in enumerate(w.layers):
        t0 = time.perf_counter()
        name = f"layer_{j:03d}.onnx"
        pb = graph.layer(j, a, lw, compute, out / name)
        layers.append(_entry(out, name, pb, _layer_flops(lw), act, kv, [out / f"{name}.data"]))
        rows.append({"file": name, "seconds": time.perf_counter() - t0})
        progress(name, j + 3, total)
    return embed, layers, head, rows, exact_head


def make_manifest(out: Path, name: str, model: Any, tok: Any, w: weights.Weights, mode: str,
                  compute: str, pieces: tuple[mf.FileEntry, list[mf.FileEntry], mf.FileEntry],
                  quant: dict[str, Any]) -> mf.Manifest:
    cfg, a = model.config, w.arch
    embed, layers, head = pieces
    rot = model.model.rotary_emb
    rope = {**source.rope_parameters(cfg), "inv_freq": [float(x) for x in rot.inv_freq.float()],
            "attention_scaling": float(getattr(rot, "attention_scaling", 1.0))}
    files = [embed, *layers, head]
    return mf.Manifest(
        name=name, architecture=cfg.model_type, weights={"none": "fp32"}.get(mode, mode),
        compute=compute, hidden_size=a.hidden, num_layers=len(layers), num_heads=a.heads,
        num_kv_heads=a.kv_heads, head_dim=a.head_dim, vocab_size=a.vocab,
        max_positions=cfg.max_position_embeddings, rope=rope, eos_token_ids=eos_ids(model, tok),
        chat_template=getattr(tok, "chat_template", None), tokenizer="tokenizer.json",
        embed=embed, head=head, layers=layers, fingerprint=mf.fingerprint_of(mf.all_sha256(files)),
        quantization=quant,
        special_tokens={k: getattr(tok, k, None) for k in ("bos_token", "eos_token")}, root=out)


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


def _check(out: Path, opts: Options) -> None:
    if out.exists() and not opts.force:
        raise EdgeliteError(f"{out} exists; pass --force to replace it")
    if opts.quantize is not None and opts.quantize not in QUANTIZE:
        raise EdgeliteError(f"--quantize {opts.quantize!r}: one of {', '.join(QUANTIZE)}")
    if opts.mode not in MODES:
        raise EdgeliteError(f"--mode {opts.mode!r}: one of {', '.join(MODES)}")


def run(src_text: str, out: Path, opts: Options, progress: Progress | None = None) -> Result:
    """Export SOURCE (folder, .gguf, hub id or alias) into `out`."""
    _check(out.resolve(), opts)
    t0 = time.perf_counter()
    src = source.resolve(src_text)
    model, tok = source.load(src)
    res = run_model(model, tok, src.name, out, opts, progress, src.gguf_path)
    res.load_seconds = time.perf_counter() - t0
    return res


def run_model(model: Any, tok: Any, name: str, out: Path, opts: Options,
              progress: Progress | None = None, gguf_path: Path | None = None) -> Result:
    """Export a loaded float32 HF model (and, for a GGUF source, its file's blocks)."""
    progress = progress or (lambda *_: None)
    out = out.resolve()
    _check(out, opts)
    source.check_supported(model.config)
    mode = opts.quantize or weights.default_mode(weights.gguf_kinds(gguf_path) if gguf_path else None)
    w = (weights.from_gguf(gguf_path, model.config, mode) if gguf_path
         else weights.from_hf(model, mode))
    compute = "fp32" if not _has_blocks(w) else opts.mode
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        embed, layers, head, rows, exact_head = write_pieces(w, compute, tmp, progress)
        tok.save_pretrained(tmp)
        if not (tmp / "tokenizer.json").is_file():
            raise EdgeliteError(f"{name}: the tokenizer has no fast (tokenizer.json) form")
        tok.backend_tokenizer.save(str(tmp / "tokenizer.json"), pretty=False)  # a third smaller
        quant = {"weights": w.describe(), "tied_embeddings": w.tied,
                 "source": "gguf" if gguf_path else "float"}
        if exact_head:
            quant["exact_head"] = exact_head
        manifest = make_manifest(tmp, name, model, tok, w, mode, compute, (embed, layers, head), quant)
        progress("verify", 0, 1)
        prompt = prompt_ids(tok, opts.prompt)
        room = min(model.config.max_position_embeddings, VERIFY_TEXT_TOKENS)
        text = [int(i) for i in tok(reference_text.TEXT)["input_ids"]][:room]
        report = verify(manifest, model, w, prompt, opts.steps,
                        transcoded=bool(gguf_path) and mode != "none", text=text)
        if not report.passed and not opts.accept_drift:
            raise report.failure()
        manifest = replace(manifest, verification=report.to_json())
        mf.write(manifest, tmp)
        _publish(tmp, out, opts.force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    final = mf.load(out)
    sizes = {e.file: e.bytes for e in final.files} | {d.file: d.bytes for e in final.files for d in e.data}
    for r in rows:
        r["mb"] = sum(sizes.get(f.strip(), 0) for f in r["file"].split("+")) / 1e6
    return Result(out, final, report, rows)


def _has_blocks(w: weights.Weights) -> bool:
    lws = [x.weight for lw in w.layers for x in (lw.q, lw.o, lw.down)]
    return any(isinstance(x, Blocks) for x in [*lws, w.embed, w.head])


def export_bytes(out: Path) -> int:
    """Everything in an export folder, in bytes."""
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())
