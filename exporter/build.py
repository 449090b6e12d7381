"""Orchestrate one export: open the source lazily, write every piece one layer at a time,
verify layer by layer, publish.

Everything is written into a temporary sibling folder and renamed onto --out at the end, so a
failure (or Ctrl-C) never leaves a half-written model folder, and an export that fails its
verification is not published (unless `accept_drift`, and then the manifest records the
measured figures). Memory is bounded by the largest layer (memory.py), not by the model.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgelite import heap
from edgelite import manifest as mf
from edgelite.errors import EdgeliteError
from edgelite_export import graph, memory, products, reference_text, resident, source, weights
from edgelite_export.blocks import Blocks

if TYPE_CHECKING:  # torch and transformers load only once the source is known to be supported
    from edgelite_export.reference import Reference
    from edgelite_export.verify import Report

log = logging.getLogger(__name__)
VERIFY_MESSAGE = "Explain in one sentence why the sky is blue."
VERIFY_TEXT_TOKENS = 768  # of reference_text.py, teacher-forced besides the prompt
Progress = Callable[[str, int, int], None]  # (what, done, total)
QUANTIZE = ("none", "int8", "int4")
MODES = ("exact", "fast")
PREFER = ("size", "speed")


@dataclass
class Options:
    quantize: str | None = None  # none | int8 | int4; None: as the source (see weights.py)
    mode: str = "fast"  # for block weights: exact (float compute) or fast (int8 activations)
    steps: int = 32  # greedy steps verified beyond the prompt
    prompt: str = VERIFY_MESSAGE
    accept_drift: bool = False  # publish even when verification misses its thresholds
    force: bool = False
    max_memory_mb: int | None = None  # None: memory.default_budget_mb()
    prefer: str = "size"  # size: 5-bit codes as 4 + 2 bits; speed: in 8-bit storage


@dataclass
class Result:
    out: Path
    manifest: mf.Manifest
    report: Report
    rows: list[dict[str, Any]] = field(default_factory=list)  # file, mb, seconds
    seconds: float = 0.0
    peak_rss_bytes: int = 0


def prompt_ids(tok: Any, text: str) -> list[int]:
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return [int(i) for i in ids]
    return [int(i) for i in tok(text)["input_ids"]]


def eos_ids(config: Any, tok: Any, folder: Path | None, extra: tuple[str, ...] = ()) -> list[int]:
    """The config's, the tokenizer's, generation_config.json's and the family's own ending
    tokens (Gemma's <end_of_turn>)."""
    found: set[int] = set()
    vocab = tok.get_vocab()
    found.update(vocab[t] for t in extra if t in vocab)
    sources: list[Any] = [config, tok]
    if folder is not None and (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        sources.append(GenerationConfig.from_pretrained(folder))
    for src in sources:
        val = getattr(src, "eos_token_id", None)
        found.update([val] if isinstance(val, int) else list(val or []))
    return sorted(found)


def _flops(w: Any) -> int:
    """2 FLOPs per weight of a linear layer, per token."""
    return 2 * int(np.prod(w.shape)) if w is not None else 0


def _layer_flops(lw: graph.LayerWeights) -> int:
    return sum(_flops(x.weight) for x in (lw.q, lw.k, lw.v, lw.o, lw.gate, lw.up, lw.down))


def _entry(out: Path, name: str, param_bytes: int, flops: int, act: int, kv: int,
           data: list[Path], window: int = 0) -> mf.FileEntry:
    p = out / name
    return mf.FileEntry(name, mf.sha256_file(p), p.stat().st_size, param_bytes, flops, act, kv,
                        tuple(mf.DataFile(d.name, mf.sha256_file(d), d.stat().st_size) for d in data),
                        window, products=products.products_of(p))


def _row(what: str, paths: list[Path], t0: float) -> dict[str, Any]:
    """A line of the export's summary: the files and their size with their data."""
    return {"file": what, "mb": sum(p.stat().st_size for p in paths) / 1e6,
            "seconds": time.perf_counter() - t0}


@dataclass
class Pieces:
    embed: mf.FileEntry
    layers: list[mf.FileEntry]
    head: mf.FileEntry
    rows: list[dict[str, Any]]
    exact_head: dict[str, Any] | None


def write_pieces(conv: weights.Converter, compute: str, out: Path, progress: Progress,
                 split5: bool = True) -> Pieces:
    """Every graph and data file, one layer in memory at a time."""
    a, n = conv.arch, conv.config.num_hidden_layers
    total = n + 2
    t0 = time.perf_counter()
    shared = graph.DataFile(out / "embed_head.data")  # a tied head reuses the table's bytes
    table = conv.embed()
    if isinstance(table, Blocks):  # narrower codes in 8-bit storage at the default zero point,
        table = table.full_width()  # as the head's products have them: a tied table stored once
    head_w = conv.head(table)
    if isinstance(head_w, Blocks):
        head_w = head_w.full_width()
    eb = graph.embed(a, table, shared, out / "embed.onnx", graph.halves_head(head_w, compute))
    hb = graph.head(a, conv.norm(), head_w, compute, shared, out / "head.onnx")
    exact_head = (graph.exact_rows(head_w, shared) if compute == "fast" and isinstance(head_w, Blocks)
                  else None)
    shared.close()
    head_flops = _flops(head_w)
    del table, head_w
    rows = [_row("embed.onnx + head.onnx", [out / "embed.onnx", out / "head.onnx", shared.path], t0)]
    progress("write embed.onnx, head.onnx", 2, total)
    act, kv = a.hidden * 4, 2 * a.kv_heads * a.head_dim * 4
    embed = _entry(out, "embed.onnx", eb, 0, act, 0, [shared.path])
    head = _entry(out, "head.onnx", hb, head_flops, act, 0, [shared.path])
    layers = []
    for j in range(n):
        t0 = time.perf_counter()
        name = f"layer_{j:03d}.onnx"
        lw = conv.layer(j)
        pb = graph.layer(j, a, lw, compute, out / name, split5)
        layers.append(_entry(out, name, pb, _layer_flops(lw), act, kv, [out / f"{name}.data"],
                             a.window(j)))
        del lw
        rows.append(_row(name, [out / name, out / f"{name}.data"], t0))
        progress(f"write {name}", j + 3, total)
    return Pieces(embed, layers, head, rows, exact_head)


def make_manifest(out: Path, name: str, opened: source.Opened, rope: dict[str, Any],
                  conv: weights.Converter, mode: str, compute: str, pieces: Pieces,
                  quant: dict[str, Any]) -> mf.Manifest:
    cfg, a, tok = opened.config, conv.arch, opened.tokenizer
    rope = {**source.rope_parameters(cfg), **rope}
    files = [pieces.embed, *pieces.layers, pieces.head]
    folder = None if opened.gguf else Path(opened.source.folder)
    return mf.Manifest(
        name=name, architecture=cfg.model_type, weights={"none": "fp32"}.get(mode, mode),
        compute=compute, hidden_size=a.hidden, num_layers=len(pieces.layers), num_heads=a.heads,
        num_kv_heads=a.kv_heads, head_dim=a.head_dim, vocab_size=a.vocab,
        max_positions=source.max_positions(cfg), rope=rope,
        eos_token_ids=eos_ids(cfg, tok, folder, conv.family.eos_tokens),
        chat_template=getattr(tok, "chat_template", None), tokenizer="tokenizer.json",
        embed=pieces.embed, head=pieces.head, layers=pieces.layers,
        fingerprint=mf.fingerprint_of(mf.all_sha256(files)), quantization=quant,
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
    if opts.steps < 1:
        raise EdgeliteError(f"--steps {opts.steps}: verification needs at least 1 greedy step")
    if opts.prefer not in PREFER:
        raise EdgeliteError(f"--prefer {opts.prefer!r}: one of {', '.join(PREFER)}")
    if opts.max_memory_mb is not None and opts.max_memory_mb < 1:
        raise EdgeliteError(f"--max-memory-mb {opts.max_memory_mb}: must be positive")


def _origin(conv: weights.Converter) -> tuple[str, bool]:
    """Where the blocks came from (verify.THRESHOLDS) and whether there are any."""
    kinds = conv.kinds
    if any(k.startswith("quantized") and k != "quantized int8" for k in kinds):
        return conv.mode, True
    if any(k.startswith("transcoded") for k in kinds):
        return "transcoded", True
    if kinds.get("quantized int8"):  # only the tables (or everything) at 8 bits
        return ("int8", True) if conv.mode == "int8" else ("transcoded", True)
    return "float", False


def run(src_text: str, out: Path, opts: Options, progress: Progress | None = None) -> Result:
    """Export SOURCE (folder, .gguf, hub id or alias) into `out`."""
    t0 = time.perf_counter()
    heap.give_back_large_blocks()  # else the freed buffers of each layer stay with the process
    progress = progress or (lambda *_: None)
    out = out.resolve()
    _check(out, opts)
    opened = source.open_source(source.resolve(src_text))
    own = weights.gguf_default_mode(opened.files)
    if opened.gguf and own != "none" and opts.quantize not in (None, "none", own):
        bits = {"int4": "4-bit (and wider)", "int8": "8-bit"}[own]
        raise EdgeliteError(f"--quantize {opts.quantize}: this GGUF's weights are {bits} blocks, "
                            f"transcoded exactly at their own width; {opts.quantize} would not "
                            f"change them: leave --quantize out (none gives float weights)")
    mode = opts.quantize or own
    from edgelite_export.reference import Reference

    ref = Reference(opened)  # transformers' model, empty: its RoPE tables are the export's
    rope = ref.rope()
    arch = weights.arch_of(opened.config, opened.family, rotary_dim=2 * len(rope["inv_freq"]),
                           local_rope="local" in rope)
    conv = weights.Converter(opened.files, opened.family, opened.config, mode, arch)
    budget = opts.max_memory_mb or memory.default_budget_mb()
    memory.check(weights.need(conv), budget, memory.rss_bytes())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        pieces = write_pieces(conv, opts.mode if mode != "none" else "fp32", tmp, progress,
                              opts.prefer == "size")
        origin, has_blocks = _origin(conv)
        compute = opts.mode if has_blocks else "fp32"
        report = _finish(opened, ref, rope, conv, (mode, compute, origin), pieces, tmp, opts,
                         budget, progress)
        _publish(tmp, out, opts.force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Result(out, mf.load(out), report, pieces.rows, time.perf_counter() - t0,
                  memory.peak_rss_bytes())


def _finish(opened: source.Opened, ref: Reference, rope: dict[str, Any], conv: weights.Converter,
            how: tuple[str, str, str], pieces: Pieces, tmp: Path, opts: Options, budget_mb: int,
            progress: Progress) -> Report:
    """Tokenizer, manifest, verification; the manifest written when it passed (or drift is
    accepted). `how`: (mode, compute, origin)."""
    from edgelite_export.verify import verify

    mode, compute, origin = how
    tok = opened.tokenizer
    tok.save_pretrained(tmp)
    if not (tmp / "tokenizer.json").is_file():
        raise EdgeliteError(f"{opened.source.name}: the tokenizer has no fast (tokenizer.json) form")
    tok.backend_tokenizer.save(str(tmp / "tokenizer.json"), pretty=False)  # a third smaller
    quant: dict[str, Any] = {"weights": conv.describe(), "tied_embeddings": conv.tied,
                             "source": "gguf" if opened.gguf else "float"}
    if pieces.exact_head:
        quant["exact_head"] = pieces.exact_head
    manifest = make_manifest(tmp, opened.model_name, opened, rope, conv, mode, compute, pieces, quant)
    prompt = prompt_ids(tok, opts.prompt)
    room = min(source.max_positions(opened.config), VERIFY_TEXT_TOKENS)
    text = [int(i) for i in tok(reference_text.TEXT)["input_ids"]][:room]
    report = verify(manifest, ref, conv, origin, prompt, opts.steps, text, budget_mb * memory.MIB,
                    progress)
    if not report.passed and not opts.accept_drift:
        raise report.failure()
    progress("measuring what each piece holds once loaded", 0, 1)
    mf.write(manifest, tmp)  # (read by the measuring processes)
    manifest = resident.measured(manifest)
    mf.write(replace(manifest, verification=report.to_json()), tmp)
    return report


def export_bytes(out: Path) -> int:
    """Everything in an export folder, in bytes."""
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())
