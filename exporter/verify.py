"""Check an export against the source model, one layer at a time, before its manifest is written.

Both engines run piece by piece on the same token sequences (the verification prompt followed
by the export's own greedy reply, and a fixed English text, reference_text.py), so neither
holds the whole model:

- the embedding: transformers' rows of the ids used, and the export's embed.onnx;
- each layer j: transformers' decoder layer with layer j's weights (reference.py) and the
  export's layer_J graph (the runtime's own engine, engine/layers.py). The export's layer runs
  twice: on its own chain's hidden states (what the logits below come from) and on the
  reference's input, whose output must match the reference layer's own (`layer_errors`,
  ||ours - ref|| / ||ref - input|| over the prompt; a layer over its mode's bound is named);
  its transcoded tensors must equal transformers' dequantized weights (max |diff| <= 1e-6 of
  the tensor's largest weight);
- then the final norm and head: the logits at every position of both sequences.

Thresholds (THRESHOLDS; exporter/DESIGN.md lists them) compare distributions, so that they
hold for any weights: the mean KL divergence of the export's next-token distribution from the
reference's, and top-1 agreement only where the reference's top choice leads the second by at
least CONFIDENT_MARGIN in probability (random weights give nearly flat distributions whose
top-1 flips on any rounding). The greedy check: the export generates `steps` tokens on its
own; the reference, teacher-forced over them, must pick the same token at each step for
`greedy_prefix` of them (fp32 exports: all of them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edgelite.engine.layers import LayerRange, ModelFiles, export_files
from edgelite.engine.runtime import Embedding, Head
from edgelite.errors import VerificationFailed
from edgelite.manifest import Manifest
from edgelite_export.blocks import Blocks
from edgelite_export.greedy import greedy, run_range, runtime_config
from edgelite_export.reference import Reference
from edgelite_export.weights import Converter

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]
TRANSCODE_TOL = 1e-6  # of max |w|, per tensor
CONFIDENT_MARGIN = 0.1  # p(top-1) - p(top-2) of the reference at a position that counts for top-1
LOGIT_ROWS = 32  # positions whose logits are held at once


@dataclass(frozen=True)
class Thresholds:
    kld: float  # mean KL divergence, at most
    top1: float  # top-1 agreement at confident positions, at least
    layer: float  # a layer's relative error on the reference's input, at most
    max_logit_diff: float | None = None  # at most (fp32 only)
    greedy_all: bool = False  # every greedy step must agree


# (compute, where the weights came from) -> thresholds. Measured on SmolLM2 (reference text):
# fp32 KLD ~1e-11; exact (blocks transcoded, float math) ~5e-11; fast (int8 activations) 0.003,
# llama.cpp's Q4_1 arithmetic 0.0031 on the same weights; random-weight models: bench_export.
THRESHOLDS: dict[tuple[str, str], Thresholds] = {
    ("fp32", "float"): Thresholds(1e-6, 1.0, 1e-4, 1e-3, greedy_all=True),
    ("exact", "transcoded"): Thresholds(1e-4, 0.995, 1e-3),
    ("fast", "transcoded"): Thresholds(0.02, 0.95, 0.1),
    ("exact", "int8"): Thresholds(0.01, 0.97, 0.05),
    ("fast", "int8"): Thresholds(0.02, 0.95, 0.1),
    ("exact", "int4"): Thresholds(0.15, 0.85, 0.3),
    ("fast", "int4"): Thresholds(0.15, 0.85, 0.3),
}


@dataclass
class Report:
    compute: str
    origin: str  # float | transcoded | int8 | int4 (quantized from floats)
    positions: int = 0
    kld: float = 0.0
    top1_agreement: float = 0.0  # at every position
    top1_confident: float = 0.0  # at confident positions
    confident_positions: int = 0
    max_logit_diff: float = 0.0
    greedy_prefix: int = 0  # of the export's own greedy tokens, those the reference also picks
    steps: int = 0
    transcode_max_rel_diff: float = 0.0
    layer_errors: list[float] = field(default_factory=list)
    first_bad_layer: int | None = None
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def limits(self) -> Thresholds:
        return THRESHOLDS[self.compute, self.origin]

    @property
    def passed(self) -> bool:
        return not self.problems

    def failure(self) -> VerificationFailed:
        where = "" if self.first_bad_layer is None else f"; first diverging layer: {self.first_bad_layer}"
        return VerificationFailed("; ".join(self.problems) + where +
                                  " (--accept-drift publishes it with these figures recorded)",
                                  layer=self.first_bad_layer)

    def judge(self) -> None:
        lim = self.limits
        bad = [j for j, e in enumerate(self.layer_errors) if e > lim.layer]
        if bad:
            self.first_bad_layer = bad[0]
            self.problems.append(f"layer {bad[0]} differs from transformers' by "
                                 f"{self.layer_errors[bad[0]]:.3g} of its update on the same input "
                                 f"(at most {lim.layer:g})")
        if self.transcode_max_rel_diff > TRANSCODE_TOL:
            self.problems.append(f"a transcoded tensor differs from the source by "
                                 f"{self.transcode_max_rel_diff:.2e} of its largest weight")
        if self.kld > lim.kld:
            self.problems.append(f"mean KL divergence from transformers {self.kld:.3g} exceeds "
                                 f"{lim.kld:g} ({self.compute})")
        if self.confident_positions and self.top1_confident < lim.top1:
            self.problems.append(f"top-1 agreement with transformers {self.top1_confident:.4f} at "
                                 f"{self.confident_positions} confident positions is below "
                                 f"{lim.top1} ({self.compute})")
        if lim.max_logit_diff is not None and self.max_logit_diff > lim.max_logit_diff:
            self.problems.append(f"max logit diff {self.max_logit_diff:.3e} exceeds "
                                 f"{lim.max_logit_diff:g}")
        if lim.greedy_all and self.greedy_prefix < self.steps:
            self.problems.append(f"greedy tokens agree for {self.greedy_prefix}/{self.steps}")

    def to_json(self) -> dict[str, Any]:
        lim = self.limits
        return {"compute": self.compute, "origin": self.origin, "positions": self.positions,
                "kld": self.kld, "top1_agreement": self.top1_agreement,
                "top1_confident": self.top1_confident,
                "confident_positions": self.confident_positions,
                "max_logit_diff": self.max_logit_diff, "greedy_prefix": self.greedy_prefix,
                "steps": self.steps, "tokens_match": self.greedy_prefix == self.steps,
                "transcode_max_rel_diff": self.transcode_max_rel_diff,
                "layer_errors": [round(e, 8) for e in self.layer_errors],
                "seconds": round(self.seconds, 2),
                "thresholds": {"kld": lim.kld, "top1_confident": lim.top1, "layer": lim.layer,
                               "max_logit_diff": lim.max_logit_diff,
                               "confident_margin": CONFIDENT_MARGIN},
                "passed": self.passed, "problems": self.problems}


# ---- comparing ----------------------------------------------------------------------------
def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@dataclass
class LogitStats:
    positions: int = 0
    kld_sum: float = 0.0
    top1: int = 0
    confident: int = 0
    confident_top1: int = 0
    max_diff: float = 0.0
    ref_argmax: list[int] = field(default_factory=list)

    def add(self, ref: np.ndarray, ours: np.ndarray) -> None:
        """Logits (positions, vocab) of both."""
        lr, lo = _log_softmax(ref), _log_softmax(ours)
        p = np.exp(lr)
        self.kld_sum += float((p * (lr - lo)).sum())
        ra, oa = ref.argmax(-1), ours.argmax(-1)
        two = np.sort(np.partition(p, -2, axis=-1)[:, -2:], axis=-1)
        sure = two[:, 1] - two[:, 0] >= CONFIDENT_MARGIN
        self.positions += ref.shape[0]
        self.top1 += int((ra == oa).sum())
        self.confident += int(sure.sum())
        self.confident_top1 += int(((ra == oa) & sure).sum())
        self.max_diff = max(self.max_diff, float(np.abs(ref - ours).max()))
        self.ref_argmax += [int(i) for i in ra]


def _rel(ours: np.ndarray, ref: np.ndarray, inp: np.ndarray) -> float:
    """||ours - ref|| / ||ref - inp||: a layer's error against its own update."""
    update = float(np.linalg.norm(ref.astype(np.float64) - inp))
    return float(np.linalg.norm(ours.astype(np.float64) - ref)) / max(update, 1e-30)


def transcode_diff(lw: Any, ref: dict[str, torch.Tensor], names: dict[str, str]) -> float:
    """The worst max |dequantized - transformers'| / max |w| over a layer's block tensors."""
    worst = 0.0
    for f, base in names.items():
        w = getattr(getattr(lw, f, None), "weight", None)
        if isinstance(w, Blocks):
            r = ref[f"{base}.weight"].numpy()
            worst = max(worst, blocks_diff(w, lambda a, b, r=r: r[a:b]))
    return worst


def blocks_diff(b: Blocks, ref_rows: Callable[[int, int], np.ndarray], rows: int = 4096) -> float:
    """max |b's dequantized values - the reference's| / max |reference|, rows at a time."""
    worst, scale = 0.0, 0.0
    for a in range(0, b.shape[0], rows):
        end = min(a + rows, b.shape[0])
        r = ref_rows(a, end)
        worst = max(worst, float(np.abs(b.rows(np.arange(a, end)).dequantize() - r).max()))
        scale = max(scale, float(np.abs(r).max()))
    return worst / max(scale, 1e-30)


# ---- the whole check ----------------------------------------------------------------------
class Check:
    """One verification run: both engines, layer by layer, over the sequences."""

    def __init__(self, manifest: Manifest, ref: Reference, conv: Converter, origin: str,
                 progress: Progress) -> None:
        self.manifest, self.ref, self.conv, self.progress = manifest, ref, conv, progress
        self.cfg = runtime_config()
        self.files: ModelFiles = export_files(manifest, verify=False)
        self.report = Report(manifest.compute, origin)
        self.transcoded = origin == "transcoded"

    def run(self, sequences: list[list[int]]) -> tuple[list[np.ndarray], list[torch.Tensor]]:
        """Every layer over the sequences: (the export's final hidden states, the reference's)."""
        m = self.manifest
        embed = Embedding(m, self.cfg, self.files)
        ours = [embed.run(np.array([s], np.int64)) for s in sequences]
        del embed
        theirs = [self.ref.embed(s) for s in sequences]
        hf_names = {f: v[0].format(j="{j}") for f, v in self.conv.family.layer.items()}
        for j in range(m.num_layers):
            weights = self.ref.layer_weights(j)
            if self.transcoded:
                names = {f: n.format(j=j) for f, n in hf_names.items()}
                self.report.transcode_max_rel_diff = max(
                    self.report.transcode_max_rel_diff,
                    transcode_diff(self.conv.layer(j), weights, names))
            outs = self.ref.run_layer(j, weights, theirs)
            del weights
            layers = LayerRange(m, j, j, self.cfg, self.files)
            ours = [run_range(layers, layers.pool.acquire(), h) for h in ours]
            on_ref = run_range(layers, layers.pool.acquire(), theirs[0].numpy())
            self.report.layer_errors.append(_rel(on_ref, outs[0].numpy(), theirs[0].numpy()))
            layers.close()
            theirs = outs
            self.progress(f"verify layer {j}", j + 1, m.num_layers)
        return ours, theirs

    def logits(self, ours: list[np.ndarray], theirs: list[torch.Tensor]) -> Iterator[LogitStats]:
        """Per sequence: the logits of both compared at every position."""
        head = Head(self.manifest, self.cfg, self.files)
        rows = sum(h.shape[1] for h in ours)
        done = 0
        for h_ours, h_ref in zip(ours, theirs, strict=True):
            stats = LogitStats()
            for a in range(0, h_ours.shape[1], LOGIT_ROWS):
                b = min(a + LOGIT_ROWS, h_ours.shape[1])
                stats.add(self.ref.logits(h_ref[:, a:b]), head.run(h_ours[:, a:b])[0])
                done += b - a
                self.progress("compare the logits at each position", done, rows)
            yield stats

    def table_diff(self) -> float:
        """The transcoded embedding (and head) against transformers' dequantized tables."""
        table = self.conv.embed()
        pairs = [(table, "model.embed_tokens.weight")]
        if not self.conv.tied:
            pairs.append((self.conv.head(table), "lm_head.weight"))
        return max((blocks_diff(b, lambda a, e, n=name: self.ref.tensor(n, (a, e)).numpy())
                    for b, name in pairs if isinstance(b, Blocks)), default=0.0)


def verify(manifest: Manifest, ref: Reference, conv: Converter, origin: str, prompt: list[int],
           steps: int, text: list[int], budget: int, progress: Progress | None = None) -> Report:
    """The export against transformers (see the module's docstring), within `budget` bytes."""
    t0 = time.perf_counter()
    progress = progress or (lambda *_: None)
    progress("greedy reply", 0, 1)
    own = greedy(manifest, prompt, steps, budget)
    check = Check(manifest, ref, conv, origin, progress)
    sequences = [prompt + own[:-1], text] if text else [prompt + own[:-1]]
    ours, theirs = check.run(sequences)
    total = LogitStats()
    for i, stats in enumerate(check.logits(ours, theirs)):
        if i == 0:  # the greedy check: the reference's picks after the prompt
            picks = stats.ref_argmax[len(prompt) - 1:]
            check.report.greedy_prefix = next(
                (k for k, (a, b) in enumerate(zip(own, picks, strict=False)) if a != b), len(own))
        for k in ("positions", "kld_sum", "top1", "confident", "confident_top1"):
            setattr(total, k, getattr(total, k) + getattr(stats, k))
        total.max_diff = max(total.max_diff, stats.max_diff)
    r = check.report
    if check.transcoded:
        r.transcode_max_rel_diff = max(r.transcode_max_rel_diff, check.table_diff())
    r.positions, r.steps, r.max_logit_diff = total.positions, len(own), total.max_diff
    r.kld = total.kld_sum / max(total.positions, 1)
    r.top1_agreement = total.top1 / max(total.positions, 1)
    r.confident_positions = total.confident
    r.top1_confident = total.confident_top1 / max(total.confident, 1)
    r.seconds = time.perf_counter() - t0
    r.judge()
    log.info("verification: %s", r.to_json())
    return r
