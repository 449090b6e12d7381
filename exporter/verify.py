"""Check the exported ONNX chain against the source model before the manifest is written.

A prompt plus N greedy steps: at every step the chain's logits are compared with transformers'
(teacher-forced on transformers' tokens) and the chain's own greedy choice must match. On the
prompt, every file's output is compared with the matching HF activation, so a failure can name
the first layer that diverged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from edgelite.engine.runtime import LocalChain, positions_for
from edgelite.errors import VerificationFailed
from edgelite.manifest import Manifest

log = logging.getLogger(__name__)
LOGIT_TOL = 1e-3  # fp32: max abs logit diff at every step
LAYER_REL_TOL = 1e-4  # a layer "diverged" when max|diff| / max(1, max|ref|) exceeds this


@dataclass
class Report:
    steps: int
    max_logit_diff: float
    token_agreement: float  # fraction of steps where the chain's greedy token == transformers'
    tokens_match: bool
    file_diff: dict[str, float] = field(default_factory=dict)  # on the prompt, relative
    first_bad_layer: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "max_logit_diff": self.max_logit_diff,
                "token_agreement": self.token_agreement, "tokens_match": self.tokens_match,
                "file_diff": self.file_diff}


def reference(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """transformers' greedy tokens and the logits (vocab,) that chose each of them."""
    tokens, logits = [], []
    ids = torch.tensor([prompt])
    past = None
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            last = out.logits[0, -1].float().numpy()
            logits.append(last)
            tokens.append(int(last.argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens, logits


def hf_activations(model: Any, prompt: list[int]) -> list[np.ndarray]:
    """[embedding, layer 0 out, ..., layer n-1 out, logits] on the prompt."""
    acts: list[np.ndarray] = []

    def hook(_m: Any, _inp: Any, out: Any) -> None:
        acts.append((out[0] if isinstance(out, tuple) else out).detach().float().numpy())

    mods = [model.model.embed_tokens, *model.model.layers]
    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return [*acts, logits.float().numpy()]


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / max(1.0, float(np.abs(ref).max())))


def per_file_diff(manifest: Manifest, chain: LocalChain, hf: list[np.ndarray],
                  prompt: list[int]) -> dict[str, float]:
    ids = np.array([prompt], np.int64)
    pos, mask = positions_for(0, len(prompt))
    hidden = chain.embed.run(ids)
    diffs = {manifest.embed.file: _rel(hidden, hf[0])}
    for j, sess in enumerate(chain.layers.sessions):
        z = np.zeros((1, manifest.num_kv_heads, 0, manifest.head_dim), np.float32)
        hidden, _, _ = sess.run(None, {"hidden": hf[j], "past_key": z, "past_value": z,
                                       "position_ids": pos, "attention_mask": mask})
        diffs[manifest.layers[j].file] = _rel(hidden, hf[j + 1])
    diffs[manifest.head.file] = _rel(chain.head.run(hf[-2]), hf[-1])
    return diffs


def verify(manifest: Manifest, model: Any, prompt: list[int], steps: int,
           strict: bool = True) -> Report:
    """Compare; with strict (fp32) raise VerificationFailed naming the first diverging layer."""
    chain = LocalChain(manifest)
    ref_tokens, ref_logits = reference(model, prompt, steps + 1)
    kv = chain.layers.new_cache()
    ids = np.array([prompt], np.int64)
    worst, agree = 0.0, 0
    for step, (tok, ref) in enumerate(zip(ref_tokens, ref_logits, strict=True)):
        logits, kv = chain.forward(ids, kv)
        worst = max(worst, float(np.abs(logits[0] - ref).max()))
        agree += int(int(logits[0].argmax()) == tok)
        ids = np.array([[tok]], np.int64)
        log.debug("verify step %d: diff %.2e", step, worst)
    diffs = per_file_diff(manifest, chain, hf_activations(model, prompt), prompt)
    n = len(ref_tokens)
    report = Report(steps, worst, agree / n, agree == n, diffs)
    if strict and (worst > LOGIT_TOL or agree != n):
        bad = [j for j, e in enumerate(manifest.layers) if diffs[e.file] > LAYER_REL_TOL]
        report.first_bad_layer = bad[0] if bad else None
        where = (f"first diverging layer: {bad[0]} ({manifest.layers[bad[0]].file}, "
                 f"relative diff {diffs[manifest.layers[bad[0]].file]:.2e})" if bad else
                 f"no single layer exceeds {LAYER_REL_TOL:g} relative; "
                 f"embed {diffs[manifest.embed.file]:.2e}, head {diffs[manifest.head.file]:.2e}")
        raise VerificationFailed(
            f"ONNX chain differs from transformers: max logit diff {worst:.3e} "
            f"(limit {LOGIT_TOL:g}), greedy tokens agree {agree}/{n}; {where}",
            layer=report.first_bad_layer)
    return report

