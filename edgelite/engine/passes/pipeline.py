"""Which passes a graph goes through as it loads, chosen by the configuration and the kernel
library's capabilities, in the order they run (passes/base.py `apply` runs them), every one
after `admit` (passes/admit.py: the graph must be one the exporter writes):

- a layer range: its attention (`attend-kernel`: the kernels' operator; `attend-plain`:
  onnxruntime's plain operators over the valid KV, a 16-bit KV without the kernel;
  `attend-padded`: a one-row step's GroupQueryAttention on two rows, a float32 KV without
  the kernel), its products (`products`, where the library has a vector path for a kind the
  manifest lists), its norms (`norms`, wherever the library runs: onnxruntime's own give
  other bits on ARM than on x86), and the products still onnxruntime's padded to two rows
  where this CPU computes one row otherwise (`products-padded`, with `invariant`);
- the head: `products`, `norms` and `products-padded` likewise; the embedding:
  `products-padded`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from edgelite.config import RuntimeConfig
from edgelite.engine import kernels
from edgelite.engine.passes import admit, attention, invariant, linear, norms, onerow
from edgelite.engine.passes.base import Pass
from edgelite.manifest import FileEntry, Manifest


def for_range(m: Manifest, entries: Sequence[FileEntry], cfg: RuntimeConfig, kv_dtype: str,
              attend: Path | None, matmul: Path | None) -> list[Pass]:
    """A joined range's passes: `attend` the library its attention runs in (None: onnxruntime's
    operators), `matmul` the one its products do (linear.library)."""
    chosen: list[Pass] = [admit.admit_pass(m)]
    if attend is not None or kv_dtype != "float32":
        chosen.append(attention.attention_pass(m.head_dim, m.rotary_dim, kv_dtype, attend is not None,
                                               cfg.threads))
    elif cfg.invariant:
        chosen.append(invariant.pad_attention_pass())
    return chosen + _products(entries, m.name, cfg, matmul, attend is not None or matmul is not None)


def for_piece(m: Manifest, entry: FileEntry, cfg: RuntimeConfig, matmul: Path | None) -> list[Pass]:
    """The head's passes (`matmul` its products' library), or the embedding's (None)."""
    return [admit.admit_pass(m), *_products([entry], m.name, cfg, matmul, matmul is not None)]


def _products(entries: Sequence[FileEntry], name: str, cfg: RuntimeConfig, matmul: Path | None,
              library: bool) -> list[Pass]:
    chosen: list[Pass] = []
    if matmul is not None:
        chosen.append(linear.products_pass(linear.listed(entries, name), cfg.threads,
                                           kernels.matmul_kinds(matmul)))
    if library:
        chosen.append(norms.norms_pass())
    if cfg.invariant:  # (the products onnxruntime still computes)
        chosen.append(onerow.pad_products_pass(cfg))
    return chosen
