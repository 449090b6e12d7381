"""Read and validate the exporter's manifest.json (shared by the exporter and the runtime).

The planner reads only this file; it never needs the ONNX files themselves. Every field is
checked for its type and range when the manifest is read (from disk or from the wire), and a
bad one is named in a one-line ManifestError.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from edgelite.errors import ManifestError, ModelFileError

FORMAT = "edgelite-model/2"
MANIFEST_NAME = "manifest.json"
WEIGHTS = ("fp32", "int8", "int4")  # how the linear layers are stored
COMPUTE = ("fp32", "exact", "fast")  # fp32 weights; blocks with float or int8 activations
KV_ITEM = {"float32": 4, "float16": 2, "int8": 1}  # the KV dtypes, bytes a value
KV_AUTO = "auto"  # RuntimeConfig.kv_dtype: chosen per export (Manifest.kv_dtype)


def kv_row_values(dtype: str, head_dim: int) -> int:
    """The values one head's KV row of `dtype` holds: head_dim, and an int8 row's step (two
    bytes: engine/passes/attention.py)."""
    return head_dim + 2 * (dtype == "int8")
_SHA = re.compile(r"^[0-9a-f]{64}$")
MAX_DIM = 1 << 20  # no model dimension is larger (a manifest saying so is corrupt)


@dataclass(frozen=True)
class DataFile:
    """An external data file holding a graph's weights."""

    file: str
    sha256: str
    bytes: int


# what a layer's weights take once onnxruntime has packed them, per byte of weights, where the
# exporter did not measure it: the largest measured on 1 B-shaped blocks (Q4_K_M fast 1.84,
# Q4_0 1.68, Q8_0 1.36, Q3_K_M 2.14); small layers cost more (Gemma 3 270M fast: 3.1)
RESIDENT_PER_PARAM_BYTE = 2.2
SCRATCH_CHUNK = 256  # the prompt chunk scratch_bytes is measured at (the default largest)
# a prompt chunk's scratch per byte of its hidden states, where not measured (1 B-shaped
# Q4_K_M: 55 MiB at 256 tokens of 8 KiB each, 27.5)
SCRATCH_PER_ACTIVATION_BYTE = 28


# a product's kinds (`Product.kind`) and the parts each names beside its MatMulNBits node:
# q4 (4-bit codes, a float scale per 32 weights), q8 (8-bit, per 32), q4_k (its scales a float16
# per 256 weights times a byte per block, and a minima product added to it), q6_k (its codes
# stored at 6 bits plus a constant, its scales like q4_k's)
PRODUCT_PARTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {  # kind -> (required, optional)
    "q4": (frozenset(), frozenset()),
    "q8": (frozenset(), frozenset()),
    "q4_k": (frozenset({"output", "minima", "scale_base", "scale_mult", "min_base", "min_mult"}),
             frozenset({"min_factor"})),
    "q6_k": (frozenset({"stream", "low", "scale_base", "scale_mult"}), frozenset()),
}
MAX_PRODUCTS = 4096  # in one graph


@dataclass(frozen=True)
class Product:
    """One product of a graph, as the exporter made it (exporter/products.py): its kind, the
    output of its MatMulNBits node, and the graph's names of its other parts (PRODUCT_PARTS).
    engine/passes/linear.py runs it by edgelite's own operator where the kind has a vector path."""

    kind: str
    node: str
    parts: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FileEntry:
    file: str  # the ONNX graph
    sha256: str
    bytes: int
    param_bytes: int  # weights as held in memory once loaded
    flops_per_token: int = 0
    activation_bytes_per_token: int = 0
    kv_bytes_per_token: int = 0
    data: tuple[DataFile, ...] = ()  # its external weight files (one may be shared: tied head)
    window: int = 0  # a layer's attention window: it attends to this many positions (0: all)
    # what the piece holds in this engine's process once loaded and run (onnxruntime's packed
    # weights and its own buffers), measured by the exporter; 0: not measured (see resident())
    resident_bytes: int = 0
    # the most it held beyond that while running a prompt chunk of SCRATCH_CHUNK tokens
    # (activations, the chunk's buffers), measured with it; 0: not measured
    scratch_bytes: int = 0
    # the most it held while it loaded (widening scales in memory), where above resident_bytes
    load_peak_bytes: int = 0
    # the same three where its products run in edgelite's product operators (a device with
    # AVX-512 VNNI and VBMI: engine/passes/linear.py), measured where the exporter's machine has them;
    # 0: not measured (the figures above hold, the larger)
    narrow_resident_bytes: int = 0
    narrow_scratch_bytes: int = 0
    narrow_load_peak_bytes: int = 0
    # its products' kinds (None: an export made before they were listed, whose products stay
    # onnxruntime's: `edgelite-export upgrade DIR` lists them)
    products: tuple[Product, ...] | None = None

    @property
    def resident(self) -> int:
        """Bytes it holds once loaded: as measured, else the weights times the largest factor
        measured on onnxruntime's packed blocks (RESIDENT_PER_PARAM_BYTE)."""
        return self.resident_bytes or int(self.param_bytes * RESIDENT_PER_PARAM_BYTE)

    def resident_on(self, narrow: bool) -> int:
        """`resident` on a device that runs edgelite's product operators (`narrow`) or not."""
        return (narrow and self.narrow_resident_bytes) or self.resident

    def load_peak_on(self, narrow: bool) -> int:
        """`load_peak_bytes` likewise (the narrow figure where it was measured)."""
        return (narrow and self.narrow_resident_bytes and self.narrow_load_peak_bytes) or self.load_peak_bytes


@dataclass(frozen=True)
class Manifest:
    name: str
    architecture: str
    weights: str  # fp32 | int8 | int4
    compute: str  # fp32 | exact | fast
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    rope: dict[str, Any]  # inv_freq (head_dim / 2 floats), attention_scaling, and the source's
    eos_token_ids: list[int]
    chat_template: str | None
    tokenizer: str
    embed: FileEntry
    head: FileEntry
    layers: list[FileEntry]
    fingerprint: str
    quantization: dict[str, Any] = field(default_factory=dict)
    verification: dict[str, Any] = field(default_factory=dict)
    special_tokens: dict[str, Any] = field(default_factory=dict)  # bos/eos text for the template
    # what a range of layers holds once however many it has (its RoPE tables, a session's own
    # state), measured by the exporter (the layers' resident_bytes are then what each adds);
    # 0: not measured (each layer's figure has it)
    range_bytes: int = 0
    narrow_range_bytes: int = 0  # the same with edgelite's product operators
    root: Path = Path(".")

    @property
    def files(self) -> list[FileEntry]:
        return [self.embed, *self.layers, self.head]

    def path(self, entry: FileEntry | DataFile) -> Path:
        return self.root / entry.file

    def kv_bytes_per_token(self, first: int, last: int) -> int:
        """A position's float32 KV in layers first..last."""
        return sum(e.kv_bytes_per_token for e in self.layers[first:last + 1])

    def kv_bytes(self, first: int, last: int, positions: int, dtype: str = "float32") -> int:
        """What a session of `positions` holds in layers first..last, its KV of `dtype`: a
        windowed layer at most its window's worth."""
        return sum(e.kv_bytes_per_token * (min(positions, e.window) if e.window else positions)
                   for e in self.layers[first:last + 1]) * KV_ITEM[dtype] \
            * kv_row_values(dtype, self.head_dim) // (KV_ITEM["float32"] * self.head_dim)

    def kv_dtype(self, asked: str, invariant: bool) -> str:
        """The KV dtype a range of this export holds: as asked, or for "auto" float16 where
        it computes fast (int8 activations: a 16-bit KV adds nothing measurable to its error,
        scripts/bench_context.py) and the attention is invariant (the only attention that
        reads a 16-bit KV), else float32 (fp32 and exact exports keep their exactness)."""
        if asked != KV_AUTO:
            return asked
        return "float16" if self.compute == "fast" and invariant else "float32"

    @property
    def scratch(self) -> int:
        """What running a prompt chunk takes beyond the layers it runs through: as measured
        (the most of any layer, either way its products run), else estimated from the hidden
        state's size."""
        measured = max((max(e.scratch_bytes, e.narrow_scratch_bytes) for e in self.layers), default=0)
        return measured or SCRATCH_PER_ACTIVATION_BYTE * SCRATCH_CHUNK * max(
            (e.activation_bytes_per_token for e in self.layers), default=0)

    def scratch_for(self, chunk: int) -> int:
        """What a prompt chunk of `chunk` tokens takes beyond the layers: `scratch` (measured at
        SCRATCH_CHUNK tokens) scaled, and for smaller chunks 15 % and 1 MiB more, at most the
        measured figure (1 B Q4_K_M, one layer: 16 tokens 4.0 MiB, 64 16.5, 256 58.7)."""
        full = self.scratch
        if chunk <= 0 or chunk == SCRATCH_CHUNK:
            return full
        if chunk > SCRATCH_CHUNK:
            return full * chunk // SCRATCH_CHUNK
        return min(full, int(full * chunk / SCRATCH_CHUNK * 1.15) + (1 << 20))

    @property
    def client_bytes(self) -> int:
        return self.client_bytes_on(False)

    def client_bytes_on(self, narrow: bool) -> int:
        """What the embedding and the head take on the client: both held, and the larger of
        their loads' transients on top (they load one after the other); `narrow`: the client
        runs edgelite's product operators."""
        pieces = (self.embed, self.head)
        return sum(e.resident_on(narrow) for e in pieces) + max(
            max(0, e.load_peak_on(narrow) - e.resident_on(narrow)) for e in pieces)

    def range_on(self, narrow: bool) -> int:
        """`range_bytes` on a device that runs edgelite's product operators (`narrow`) or not."""
        return (narrow and self.narrow_range_bytes) or self.range_bytes

    def resident(self, first: int, last: int, narrow: bool = False) -> int:
        """What layers first..last hold once loaded as one range (FileEntry.resident_on, and
        the range's own part once)."""
        return sum(e.resident_on(narrow) for e in self.layers[first:last + 1]) + self.range_on(narrow)

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head RoPE rotates (all of head_dim unless partial)."""
        return 2 * len(self.rope["inv_freq"])

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("root")
        return {"format": FORMAT, **data}


def fingerprint_of(sha256s: list[str]) -> str:
    """Names the model everywhere: a hash over all files' sha256, in chain order."""
    return hashlib.sha256("\n".join(sha256s).encode()).hexdigest()[:32]


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def all_sha256(entries: list[FileEntry]) -> list[str]:
    """Every file's sha256 in chain order, each graph followed by its data files."""
    return [s for e in entries for s in (e.sha256, *(d.sha256 for d in e.data))]


# ---- validation ---------------------------------------------------------------------------
def _int(v: Any, where: str, lo: int = 0, hi: int = 1 << 50) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise ManifestError(f"{where} must be an integer in {lo}..{hi}, not {str(v)[:40]!r}")
    return v


def _str(v: Any, where: str, max_len: int = 256) -> str:
    if type(v) is not str or not v or len(v) > max_len:
        raise ManifestError(f"{where} must be a non-empty string, not {str(v)[:40]!r}")
    return v


def _file_name(v: Any, where: str) -> str:
    name = _str(v, where)
    if "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise ManifestError(f"{where}: file name {name!r} must be a plain name inside the folder")
    return name


def _sha(v: Any, where: str) -> str:
    if type(v) is not str or not _SHA.fullmatch(v):
        raise ManifestError(f"{where} is not a sha256 hex digest")
    return v


def _data(raw: Any, where: str) -> DataFile:
    if type(raw) is not dict:
        raise ManifestError(f"{where}: expected an object")
    return DataFile(_file_name(raw.get("file"), f"{where}.file"), _sha(raw.get("sha256"), f"{where}.sha256"),
                    _int(raw.get("bytes"), f"{where}.bytes"))


def _entry(raw: Any, where: str) -> FileEntry:
    if type(raw) is not dict:
        raise ManifestError(f"{where}: expected an object, got {type(raw).__name__}")
    known = {f.name for f in fields(FileEntry)}
    if extra := set(raw) - known:
        raise ManifestError(f"{where}: unknown field {sorted(extra)[0]!r}")
    data = raw.get("data", [])
    if type(data) is not list or len(data) > 8:
        raise ManifestError(f"{where}.data must be a list of at most 8 data files")
    return FileEntry(
        _file_name(raw.get("file"), f"{where}.file"), _sha(raw.get("sha256"), f"{where}.sha256"),
        _int(raw.get("bytes"), f"{where}.bytes"), _int(raw.get("param_bytes"), f"{where}.param_bytes"),
        _int(raw.get("flops_per_token", 0), f"{where}.flops_per_token"),
        _int(raw.get("activation_bytes_per_token", 0), f"{where}.activation_bytes_per_token"),
        _int(raw.get("kv_bytes_per_token", 0), f"{where}.kv_bytes_per_token"),
        tuple(_data(d, f"{where}.data[{i}]") for i, d in enumerate(data)),
        _int(raw.get("window", 0), f"{where}.window", 0, MAX_DIM),
        _int(raw.get("resident_bytes", 0), f"{where}.resident_bytes"),
        _int(raw.get("scratch_bytes", 0), f"{where}.scratch_bytes"),
        _int(raw.get("load_peak_bytes", 0), f"{where}.load_peak_bytes"),
        _int(raw.get("narrow_resident_bytes", 0), f"{where}.narrow_resident_bytes"),
        _int(raw.get("narrow_scratch_bytes", 0), f"{where}.narrow_scratch_bytes"),
        _int(raw.get("narrow_load_peak_bytes", 0), f"{where}.narrow_load_peak_bytes"),
        _products(raw.get("products"), f"{where}.products"))


def _products(raw: Any, where: str) -> tuple[Product, ...] | None:
    if raw is None:
        return None
    if type(raw) is not list or len(raw) > MAX_PRODUCTS:
        raise ManifestError(f"{where} must be a list of at most {MAX_PRODUCTS} products")
    out = []
    for i, p in enumerate(raw):
        at = f"{where}[{i}]"
        if type(p) is not dict or set(p) - {"kind", "node", "parts"}:
            raise ManifestError(f"{at} must be an object of kind, node and parts")
        kind = p.get("kind")
        if kind not in PRODUCT_PARTS:
            raise ManifestError(f"{at}.kind {str(kind)[:20]!r} is not one of {', '.join(PRODUCT_PARTS)}")
        parts = p.get("parts", {})
        required, optional = PRODUCT_PARTS[kind]
        if type(parts) is not dict or not required <= set(parts) <= required | optional:
            may = f" (and may name {', '.join(sorted(optional))})" if optional else ""
            raise ManifestError(f"{at}.parts of a {kind} product must name "
                                f"{', '.join(sorted(required)) or 'nothing'}{may}")
        out.append(Product(kind, _str(p.get("node"), f"{at}.node", 4096),
                           {k: _str(v, f"{at}.parts.{k}", 4096) for k, v in parts.items()}))
    return tuple(out)


def _rope(raw: Any, head_dim: int, where: str) -> dict[str, Any]:
    """RoPE's frequencies (a table for every layer, and `local`, the windowed layers' own
    where the model has one): at most head_dim / 2 (partial rotary) positive numbers each."""
    if type(raw) is not dict:
        raise ManifestError(f"{where}.rope must be an object")
    for table, what in ((raw, "rope"), (raw.get("local"), "rope.local")):
        if table is None:
            continue
        if type(table) is not dict:
            raise ManifestError(f"{where}.{what} must be an object")
        inv = table.get("inv_freq")
        if type(inv) is not list or not 0 < len(inv) <= head_dim // 2 or not all(
                type(x) in (int, float) and math.isfinite(x) and x > 0 for x in inv):
            raise ManifestError(f"{where}.{what}.inv_freq must be 1..{head_dim // 2} positive numbers")
        scaling = table.get("attention_scaling", 1.0)
        if type(scaling) not in (int, float) or not 0 < scaling < 100:
            raise ManifestError(f"{where}.{what}.attention_scaling must be a positive number")
    if raw.get("local") is not None and len(raw["local"]["inv_freq"]) != len(raw["inv_freq"]):
        raise ManifestError(f"{where}.rope.local must rotate as many dimensions as rope")
    return raw


def parse(data: Any, root: Path) -> Manifest:
    where = str(root / MANIFEST_NAME)
    if type(data) is not dict:
        raise ManifestError(f"{where}: expected a JSON object")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise ManifestError(f"{where}: manifest format {str(fmt)[:40]!r}, this edgelite reads "
                            f"{FORMAT!r} (export the model again with this version)")
    required = [f.name for f in fields(Manifest) if f.name != "root"]
    optional = {"quantization", "verification", "special_tokens", "chat_template", "range_bytes",
                "narrow_range_bytes"}
    if missing := [k for k in required if k not in data and k not in optional]:
        raise ManifestError(f"{where}: missing fields {', '.join(missing)}")
    if extra := sorted(set(data) - set(required) - {"format"}):
        raise ManifestError(f"{where}: unknown field {extra[0]!r}")
    dims = {k: _int(data[k], f"{where}: {k}", 1, MAX_DIM) for k in (
        "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
        "max_positions")}
    if dims["num_heads"] % dims["num_kv_heads"] or dims["head_dim"] % 2:
        raise ManifestError(f"{where}: num_heads must be a multiple of num_kv_heads and head_dim even")
    if data["weights"] not in WEIGHTS or data["compute"] not in COMPUTE:
        raise ManifestError(f"{where}: weights must be one of {WEIGHTS} and compute one of {COMPUTE}")
    eos = data["eos_token_ids"]
    if type(eos) is not list or not all(type(t) is int and 0 <= t < dims["vocab_size"] for t in eos):
        raise ManifestError(f"{where}: eos_token_ids must be a list of token ids below vocab_size")
    template = data.get("chat_template")
    if template is not None and type(template) is not str:
        raise ManifestError(f"{where}: chat_template must be a string or null")
    for k in ("quantization", "verification", "special_tokens"):
        if type(data.get(k, {})) is not dict:
            raise ManifestError(f"{where}: {k} must be an object")
    layers = data["layers"]
    if type(layers) is not list or len(layers) != dims["num_layers"]:
        raise ManifestError(f"{where}: num_layers is {dims['num_layers']} but "
                            f"{len(layers) if type(layers) is list else 'no'} layer files are listed")
    m = Manifest(
        name=_str(data["name"], f"{where}: name"),
        architecture=_str(data["architecture"], f"{where}: architecture"),
        weights=data["weights"], compute=data["compute"], **dims,
        rope=_rope(data["rope"], dims["head_dim"], where), eos_token_ids=eos, chat_template=template,
        tokenizer=_file_name(data["tokenizer"], f"{where}: tokenizer"),
        embed=_entry(data["embed"], "embed"), head=_entry(data["head"], "head"),
        layers=[_entry(e, f"layers[{i}]") for i, e in enumerate(layers)],
        fingerprint=_str(data["fingerprint"], f"{where}: fingerprint", 64),
        quantization=data.get("quantization", {}), verification=data.get("verification", {}),
        special_tokens=data.get("special_tokens", {}),
        range_bytes=_int(data.get("range_bytes", 0), f"{where}: range_bytes"),
        narrow_range_bytes=_int(data.get("narrow_range_bytes", 0), f"{where}: narrow_range_bytes"),
        root=root)
    if fingerprint_of(all_sha256(m.files)) != m.fingerprint:
        raise ManifestError(f"{where}: fingerprint does not match the files' sha256")
    return m


def load(model_dir: str | Path) -> Manifest:
    """Read DIR/manifest.json (no file checks: the planner needs only this)."""
    root = Path(model_dir)
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"{path}: no manifest (is {root} a folder written by edgelite-export?)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(f"{path}: not readable JSON: {exc}") from exc
    return parse(data, root)


def check_file(path: Path, sha256: str, size: int, verify_hash: bool = True) -> Path:
    """The file's path, after checking it exists, has the listed size and (optionally) sha256."""
    if not path.is_file():
        raise ModelFileError(f"{path}: missing (listed in the manifest)")
    got = path.stat().st_size
    if got != size:
        raise ModelFileError(f"{path}: {got} bytes on disk, manifest says {size} "
                             f"(truncated or replaced?)")
    if verify_hash and sha256_file(path) != sha256:
        raise ModelFileError(f"{path}: sha256 differs from the manifest (corrupt or replaced)")
    return path


def write(manifest: Manifest, out_dir: Path) -> Path:
    path = out_dir / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_json(), indent=1))
    return path
