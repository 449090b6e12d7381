"""onnxruntime sessions: options (threads, no spinning, no arena), execution providers, and
opening a graph whose weights are in external data files."""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort

from edgelite.config import RuntimeConfig
from edgelite.errors import EdgeliteError, ModelFileError

log = logging.getLogger(__name__)
PROVIDERS = {"cpu": "CPUExecutionProvider", "xnnpack": "XnnpackExecutionProvider",
             "nnapi": "NnapiExecutionProvider"}


def providers(cfg: RuntimeConfig) -> list[str]:
    """The providers to ask for (CPU last, for every op the chosen one lacks); a clear error
    when this onnxruntime build does not have the one asked for."""
    name = PROVIDERS.get(cfg.provider)
    if name is None:
        raise EdgeliteError(f"unknown provider {cfg.provider!r}; one of {', '.join(PROVIDERS)}")
    have = ort.get_available_providers()
    if name not in have:
        raise EdgeliteError(f"this onnxruntime ({ort.__version__}) has no {cfg.provider} "
                            f"execution provider; it has {', '.join(have)}")
    return [name] if name == "CPUExecutionProvider" else [name, "CPUExecutionProvider"]


def options(cfg: RuntimeConfig, folder: Path) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = cfg.threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_cpu_mem_arena = cfg.cpu_arena
    opts.enable_mem_pattern = False  # shapes change (chunks, batches): no plan to keep
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if cfg.allow_spinning else "0")
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    opts.log_severity_level = 3
    return opts


def open_model(model: bytes, folder: Path, cfg: RuntimeConfig, what: str) -> ort.InferenceSession:
    """A session for a graph (bytes) whose external data files are in `folder`."""
    try:
        return ort.InferenceSession(model, options(cfg, folder), providers=providers(cfg))
    except EdgeliteError:
        raise
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ModelFileError(f"{what}: onnxruntime cannot load it: {str(exc).splitlines()[0]}") from exc
