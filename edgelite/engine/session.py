"""onnxruntime sessions: options (threads, no spinning, no arena), execution providers, and
opening a graph whose weights are in external data files."""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import onnxruntime as ort

from edgelite.config import RuntimeConfig
from edgelite.engine import fold
from edgelite.errors import EdgeliteError, ModelFileError

log = logging.getLogger(__name__)
_pool_threads: int | None = None  # the process-wide pool's size, once made
# each session's folded tensors (engine/fold.py): onnxruntime reads them in place, so they
# live as long as the session
_folded: weakref.WeakKeyDictionary[ort.InferenceSession, fold.Folded] = weakref.WeakKeyDictionary()
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


def _shared_pool(cfg: RuntimeConfig) -> bool:
    """One intra-op thread pool for every session of the process (the embedding, the layers
    and the head run one after another): separate pools' spinning threads would fight over the
    cores. It can only be made before the process's first session; once it exists, every
    session must use it. True: use it."""
    global _pool_threads
    if _pool_threads is None:
        if cfg.threads == 1 or not cfg.allow_spinning:
            _pool_threads = 0  # per-session pools from now on
            return False
        try:
            ort.capi._pybind_state.set_global_thread_pool_sizes(cfg.threads, 1)
        except RuntimeError as exc:  # the environment exists already (another user of onnxruntime)
            log.debug("no shared thread pool: %s", exc)
            _pool_threads = 0
        else:
            _pool_threads = cfg.threads
    if _pool_threads and _pool_threads != cfg.threads:
        log.info("this process's onnxruntime pool has %d threads; %d asked", _pool_threads, cfg.threads)
    return bool(_pool_threads)


def options(cfg: RuntimeConfig, folder: Path) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    if _shared_pool(cfg):
        opts.use_per_session_threads = False
    else:
        opts.intra_op_num_threads = cfg.threads
        opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_cpu_mem_arena = cfg.cpu_arena
    opts.enable_mem_pattern = False  # shapes change (chunks, batches): no plan to keep
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if cfg.allow_spinning else "0")
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    opts.log_severity_level = 3
    if cfg.profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = cfg.profile_prefix
    return opts


def _fold(model: bytes, folder: Path, what: str) -> fold.Folded | None:
    """The graph folded (engine/fold.py), or None when its file cannot be written (then
    onnxruntime folds it, into memory it keeps)."""
    try:
        return fold.fold(model, folder)
    except OSError as exc:
        log.warning("%s: folding its constants needs a file beside the weights or in the temporary "
                    "folder (%s); onnxruntime folds them in memory instead", what, exc.strerror or exc)
        return None


@contextlib.contextmanager
def _trimming(folded: fold.Folded | None, every_s: float) -> Iterator[None]:
    """While onnxruntime packs the folded tensors, their pages are dropped every `every_s`
    (a page it has packed is not read again; one it has not is read back from the file): the
    load's peak holds the packed copies and a few milliseconds of reading, not the whole
    widened table as well."""
    if folded is None or folded.mapping is None or every_s <= 0:
        yield
        return
    stop = threading.Event()

    def trim() -> None:
        while not stop.wait(every_s):
            folded.release()

    thread = threading.Thread(target=trim, name="fold-trim", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def open_model(model: bytes, folder: Path, cfg: RuntimeConfig, what: str,
               library: Path | None = None, resident: tuple[str, ...] = ()) -> ort.InferenceSession:
    """A session for a graph (bytes) whose external data files are in `folder`; `library`:
    a custom operator library it uses (engine/kernels); `resident`: prefixes of folded
    tensors its operators read in place at every step, mapped in before it returns."""
    try:
        opts = options(cfg, folder)
        if library is not None:
            opts.register_custom_ops_library(str(library))
        folded = _fold(model, folder, what) if cfg.fold_at_load else None
        if folded is not None:
            folded.add_to(opts)
            model = folded.model
        with _trimming(folded, cfg.fold_trim_s):
            session = ort.InferenceSession(model, opts, providers=providers(cfg))
        if folded is not None and folded.names:
            folded.release()
            folded.populate(resident)
            _folded[session] = folded
        return session
    except ModelFileError as exc:
        raise ModelFileError(f"{what}: {exc}") from exc
    except EdgeliteError:
        raise
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ModelFileError(f"{what}: onnxruntime cannot load it: {str(exc).splitlines()[0]}") from exc
