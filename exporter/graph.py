"""Build the exported ONNX graphs from weights: the embedding, one file per decoder layer, the head.

Every weight lives in an external data file next to its graph (onnxruntime maps them, and a
session made from such a graph does not hold a second copy); graphs are small. The contract
with the runtime (edgelite/engine/):

  embed.onnx    input_ids (batch, seq) int64 -> hidden_0 (batch, seq, hidden) float32
  layer_J.onnx  hidden_J (batch, seq, hidden), past_key_J, past_value_J (batch, kv_heads, cap,
                head_dim) [one buffer with present_key_J, present_value_J: bound in place],
                seqlens_k (batch,) int32 [tokens held after this step - 1], total_seq () int32,
                cos_cache, sin_cache (positions, head_dim / 2)
                -> hidden_{J+1}, present_key_J, present_value_J
  head.onnx     hidden (batch, seq, hidden) -> logits (batch, seq, vocab)

Layer names are namespaced (/model/layers.J/...) so that the runtime can join the layer graphs
of a range into one graph (engine/onnxgraph.py). Attention is onnxruntime's GroupQueryAttention
with rotary embedding built in; linear layers are MatMul (fp32) or MatMulNBits (blocks), with
the minima of w = d*q + m formats as an extra product of the input's block sums.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgelite_export.blocks import Blocks, Factored, concat_rows

OPSET = 17
IR_VERSION = 9  # onnxruntime 1.29 (Termux) reads it
MS = "com.microsoft"
ALIGN = 4096  # large tensors start on a page: onnxruntime can map them
FP16_SCALES = (2, 4, 8)  # storage widths whose exactly-float16 scales are stored as float16


@dataclass(frozen=True)
class Arch:
    """The model's shape and what its family's layer graph does (families.py)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    act: str = "silu"  # the gated MLP's activation: silu | gelu_tanh
    attn_scale: float = 0.0  # softmax scale (0: 1/sqrt(head_dim))
    embed_scale: float = 1.0  # embeddings are multiplied by this (Gemma: sqrt(hidden))
    windows: tuple[int, ...] = ()  # per layer: its attention window (0: full attention)
    local_rope: bool = False  # windowed layers take their own RoPE table (cos_cache_local)
    rotary_dim: int = 0  # rotated dimensions of a head (0: all of head_dim)

    def window(self, j: int) -> int:
        return self.windows[j] if j < len(self.windows) else 0


@dataclass
class Linear:
    weight: np.ndarray | Blocks  # float (N, K) or blocks
    bias: np.ndarray | None = None


@dataclass
class LayerWeights:
    ln1: np.ndarray  # the norm before attention (its scale)
    ln2: np.ndarray  # the norm before the MLP
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    gate: Linear
    up: Linear
    down: Linear
    q_norm: np.ndarray | None = None  # per-head RMS norms of q and k before RoPE
    k_norm: np.ndarray | None = None
    attn_out_norm: np.ndarray | None = None  # the attention's output normed before the residual
    mlp_out_norm: np.ndarray | None = None  # the MLP's output normed before the residual


class DataFile:
    """An external data file being written; the same bytes written twice are stored once (a
    tied head's vocabulary projection is the embedding table itself)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f = open(path, "wb")
        self.where: dict[bytes, tuple[int, int]] = {}  # digest of the bytes -> (offset, length)

    def put(self, a: np.ndarray) -> tuple[int, int]:
        data = memoryview(np.ascontiguousarray(a)).cast("B")  # the array's own bytes, no copy
        key = hashlib.blake2b(data, digest_size=20).digest()
        if key not in self.where:
            pos = self.f.tell()
            if len(data) >= ALIGN and pos % ALIGN:
                self.f.write(b"\0" * (ALIGN - pos % ALIGN))
            self.where[key] = (self.f.tell(), len(data))
            self.f.write(data)
        return self.where[key]

    def close(self) -> None:
        self.f.close()


_DTYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
           np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int64): TensorProto.INT64,
           np.dtype(np.int32): TensorProto.INT32, np.dtype(np.int8): TensorProto.INT8}


class Graph:
    """Nodes, inputs, outputs and initializers of one graph being built."""

    def __init__(self, name: str, data: DataFile) -> None:
        self.name, self.data = name, data
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.param_bytes = 0
        self._n = 0

    def init(self, name: str, a: np.ndarray) -> str:
        """An initializer, external when larger than a few bytes."""
        t = TensorProto()
        t.name, t.data_type = name, _DTYPES[a.dtype]
        t.dims.extend(a.shape)
        if a.nbytes <= 64:
            t.raw_data = np.ascontiguousarray(a).tobytes()
        else:
            offset, length = self.data.put(a)
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", self.data.path.name), ("offset", str(offset)),
                               ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
        self.inits.append(t)
        self.param_bytes += a.nbytes
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str] | int, name: str,
             domain: str = "", **attrs: object) -> list[str]:
        if isinstance(outputs, int):
            outputs = [f"{name}/output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain or None,
                                           **attrs))
        return outputs

    def input(self, name: str, elem: int, shape: list[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name: str, elem: int, shape: list[int | str]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def save(self, path: Path) -> None:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                        helper.make_opsetid(MS, 1)],
                                  ir_version=IR_VERSION, producer_name="edgelite-export")
        path.write_bytes(model.SerializeToString())


class Linears:
    """Emits linear layers into a graph: MatMul for floats, MatMulNBits for blocks (accuracy
    level 0 in exact mode, 4 in fast mode), as the products `Blocks.products` gives: in exact
    mode 8-bit storage runs as two 4-bit products (the fast float kernel is 4-bit only), in fast
    mode 5-bit codes run as 4 + 2 bits. Scales and minima are stored as compactly as they are
    exact (float16, or a K-quant's float16 x small integer) and widened when the model loads."""

    def __init__(self, g: Graph, compute: str, split5: bool = True) -> None:
        self.g, self.compute, self.split5 = g, compute, split5
        self.sums: dict[tuple[str, int], str] = {}  # (input, block) -> its block sums
        # a stored matrix (its id, the object kept alive so that the id stays its), factor -> name
        self.stored: dict[tuple[int, float], tuple[object, str]] = {}

    def __call__(self, x: str, lin: Linear, name: str, k: int) -> str:
        w = lin.weight
        if isinstance(w, np.ndarray):
            y = self.g.node("MatMul", [x, self.g.init(f"{name}.weight", np.ascontiguousarray(w.T))],
                            1, f"{name}/MatMul")[0]
            if lin.bias is not None:
                y = self.g.node("Add", [y, self.g.init(f"{name}.bias", lin.bias)], 1, f"{name}/Add")[0]
            return y
        parts = w.products(self.compute, self.split5)
        y, scales = None, []
        for i, part in enumerate(parts):
            bias = lin.bias if i == 0 else None
            label = f"{name}/part{i}" if len(parts) > 1 else name
            # a split's high part has the low part's scales times 16: computed, not stored again
            times = 16 if i and np.array_equal(part.scale, parts[0].scale * 16) else 0
            term, sc = self._nbits(x, part, label, k, bias, (scales[0], times) if times else None)
            scales.append(sc)
            y = term if y is None else self.g.node("Add", [y, term], 1, f"{name}/Add{i}")[0]
        assert y is not None
        minima = [(p, sc) for p, sc in zip(parts, scales, strict=True) if p.minimum is not None]
        if minima:  # the minima term: x's block sums times each block's minimum
            mins = self._minima(minima, f"{name}.minima")
            extra = self.g.node("MatMul", [self._block_sums(x, w.block, k), mins], 1,
                                f"{name}/minima/MatMul")[0]
            y = self.g.node("Add", [y, extra], 1, f"{name}/minima/Add")[0]
        return y

    def _minima(self, parts: list[tuple[Blocks, str]], name: str) -> str:
        """The (blocks, N) minima matrix: stored as is, factored, or (a centred matrix) as its
        base plus shift x the product's own scales, computed when the model loads."""
        p, scales = parts[0]
        if len(parts) == 1 and p.minimum_parts is not None:
            base, shift = p.minimum_parts
            k = self.g.init(f"{name}.shift", np.array(shift, np.float32))
            out = self.g.node("Mul", [scales, k], 1, f"{name}/Mul")[0]
            if base is not None:
                b = self._matrix(base if isinstance(base, Factored) else None, base if isinstance(
                    base, np.ndarray) else np.zeros(0), isinstance(base, np.ndarray), f"{name}.base")
                out = self.g.node("Add", [b, out], 1, f"{name}/Add")[0]
            return self.g.node("Transpose", [out], [name], f"{name}/Transpose", perm=[1, 0])[0]
        if len(parts) == 1 and p.minimum_factored is not None:
            m = self._matrix(p.minimum_factored, p.minimum, False, f"{name}.factored")
            return self.g.node("Transpose", [m], [name], f"{name}/Transpose", perm=[1, 0])[0]
        total = np.sum([q.minimum for q, _ in parts], axis=0, dtype=np.float32)
        return self._scales(np.ascontiguousarray(total.T), len(parts) == 1 and p.minimum_fp16, name)

    def _matrix(self, factored: Factored | None, value: np.ndarray, fp16: bool, name: str) -> str:
        """A per-block (N, blocks) float matrix from its compact storage (computed at load)."""
        if factored is None:
            return self._scales(value, fp16, name)
        key = (id(factored.base), factored.sign * factored.factor)
        if key in self.stored:
            return self.stored[key][1]
        base_key = (id(factored.base), 0.0)
        if base_key not in self.stored:  # d (float16) x sc (small integers), per block
            g = self.g
            n, s = factored.base.shape
            per = factored.mult.shape[1] // s
            base = g.node("Cast", [g.init(f"{name}.base_fp16", factored.base)], 1, f"{name}/base/Cast",
                          to=TensorProto.FLOAT)[0]
            base = g.node("Unsqueeze", [base, g.init(f"{name}.axis", np.array([-1], np.int64))], 1,
                          f"{name}/Unsqueeze")[0]
            mult = g.node("Cast", [g.init(f"{name}.mult", factored.mult)], 1, f"{name}/mult/Cast",
                          to=TensorProto.FLOAT)[0]
            mult = g.node("Reshape", [mult, g.init(f"{name}.grouped", np.array([n, s, per], np.int64))],
                          1, f"{name}/Reshape")[0]
            prod = g.node("Mul", [mult, base], 1, f"{name}/Mul")[0]
            self.stored[base_key] = (factored.base, g.node("Reshape", [prod, g.init(
                f"{name}.flat", np.array([n, s * per], np.int64))], 1, f"{name}/Flatten")[0])
        out = self.stored[base_key][1]
        if factored.sign * factored.factor != 1:
            k = self.g.init(f"{name}.factor", np.array(factored.sign * factored.factor, np.float32))
            out = self.g.node("Mul", [out, k], 1, f"{name}/factor/Mul")[0]
        self.stored[key] = (factored.base, out)
        return out

    def _scales(self, a: np.ndarray, fp16: bool, name: str) -> str:
        if not fp16:
            return self.g.init(name, a.astype(np.float32))
        half = self.g.init(f"{name}_fp16", a.astype(np.float16))
        return self.g.node("Cast", [half], [name], f"{name}/Cast", to=TensorProto.FLOAT)[0]

    def _nbits(self, x: str, b: Blocks, name: str, k: int, bias: np.ndarray | None,
               scaled: tuple[str, int] | None = None) -> tuple[str, str]:
        """The product, and the name of its scales (`scaled`: another product's scales times
        a factor)."""
        n = b.shape[0]
        if scaled is not None:
            times = self.g.init(f"{name}.times", np.array(scaled[1], np.float32))
            scales = self.g.node("Mul", [scaled[0], times], 1, f"{name}/scales/Mul")[0]
        else:
            scales = self._matrix(b.scale_factored, b.scale, b.scale_fp16 and b.bits in FP16_SCALES,
                                  f"{name}.scales")
        ins = [x, self.codes(b, f"{name}.qweight"), scales]
        zp = b.zero_points()
        ins.append("" if zp is None else self.g.init(f"{name}.zero_points", zp))
        if bias is not None:
            ins += ["", self.g.init(f"{name}.bias", bias.astype(np.float32))]
        while ins[-1] == "":
            ins.pop()
        level = 0 if self.compute == "exact" else 4
        return self.g.node("MatMulNBits", ins, 1, f"{name}/MatMulNBits", MS, K=k, N=n,
                           bits=b.bits, block_size=b.block, accuracy_level=level)[0], scales

    def codes(self, b: Blocks, name: str, shape: tuple[int, ...] | None = None) -> str:
        """MatMulNBits' B (or, with `shape`, the same bytes in that shape: GatherBlockQuantized's
        data): as it is, or, when its codes span fewer values than the storage holds (Q6_K's 64
        in 8-bit storage, Q3_K's 8 and Q2_K's 4 in 4-bit storage, the fifth bit of 5-bit codes
        in 2-bit storage), at their own width in the file (`Blocks.narrow`), widened to the storage by
        the graph when the model loads (engine/fold.py computes it before onnxruntime prepacks
        the product: the same kernel at the same speed; only the files shrink)."""
        n, k = b.shape
        shape = shape or (n, k // b.block, b.block * b.bits // 8)
        found = b.narrow
        if found is None:
            return self.g.init(name, b.packed().reshape(shape))
        stream, width, lo = found
        g = self.g
        g.param_bytes += b.q.size * b.bits // 8 - stream.size  # (held widened once loaded)
        data = g.init(f"{name}.{width}bit", np.ascontiguousarray(stream))
        const: dict[int, str] = {}

        def shift(v: str, bits: int, way: str) -> str:
            if not bits:
                return v
            if bits not in const:
                const[bits] = g.init(f"{name}.by{bits}", np.array(bits, np.uint8))
            return g.node("BitShift", [v, const[bits]], 1, f"{v}/{way}{bits}", direction=way)[0]

        def field(v: str, start: int, count: int) -> str:
            """Bits start..start+count-1 of each byte of v, in the low bits (no carries)."""
            return shift(shift(v, 8 - start - count, "LEFT"), 8 - count, "RIGHT")

        def column(v: str, j: int, label: str) -> str:
            return g.node("Gather", [v, g.init(f"{name}.{label}{j}", np.array([j], np.int64))], 1,
                          f"{name}/{label}{j}", axis=1)[0]

        byte = [column(data, i, "byte") for i in range(width)]
        codes = []
        for j in range(8):
            at, off = divmod(width * j, 8)
            take = min(width, 8 - off)
            code = field(byte[at], off, take)
            if take < width:  # (the rest in the next byte's low bits)
                high = shift(field(byte[at + 1], 0, width - take), take, "LEFT")
                code = g.node("Add", [code, high], 1, f"{name}/code{j}")[0]
            codes.append(code)
        out = g.node("Concat", codes, 1, f"{name}/Concat", axis=1)[0]
        if lo:
            out = g.node("Add", [out, g.init(f"{name}.low", np.array(lo, np.uint8))], 1,
                         f"{name}/Add")[0]
        per = 8 // b.bits
        if per > 1:  # (into the storage: `per` codes a byte, the first lowest)
            out = g.node("Reshape", [out, g.init(f"{name}.per", np.array([-1, per], np.int64))], 1,
                         f"{name}/Reshape{per}")[0]
            total = column(out, 0, "slot")
            for t in range(1, per):
                total = g.node("Add", [total, shift(column(out, t, "slot"), b.bits * t, "LEFT")], 1,
                               f"{name}/pack{t}")[0]
            out = total
        return g.node("Reshape", [out, g.init(f"{name}.shape", np.array(shape, np.int64))],
                      [name], f"{name}/Reshape")[0]

    def _block_sums(self, x: str, block: int, k: int) -> str:
        key = (x, block)
        if key not in self.sums:
            base = f"{x}/block_sums{block}"
            shape = self.g.init(f"{base}.shape", np.array([0, 0, k // block, block], np.int64))
            axes = self.g.init(f"{base}.axes", np.array([-1], np.int64))
            r = self.g.node("Reshape", [x, shape], 1, f"{base}/Reshape")[0]
            self.sums[key] = self.g.node("ReduceSum", [r, axes], 1, f"{base}/ReduceSum",
                                         keepdims=0)[0]
        return self.sums[key]


def _pack(parts: list[Linear]) -> Linear | None:
    """One projection for several (q, k, v or gate, up) when their weights share a form."""
    ws = [p.weight for p in parts]
    if all(isinstance(w, np.ndarray) for w in ws):
        weight: np.ndarray | Blocks | None = np.concatenate(ws)  # type: ignore[arg-type]
    elif all(isinstance(w, Blocks) for w in ws):
        weight = concat_rows(ws)  # type: ignore[arg-type]
    else:
        weight = None
    if weight is None:
        return None
    biases = [p.bias for p in parts]
    if all(b is None for b in biases):
        return Linear(weight)
    rows = [w.shape[0] for w in ws]
    return Linear(weight, np.concatenate([b if b is not None else np.zeros(r, np.float32)
                                          for b, r in zip(biases, rows, strict=True)]))


def layer(j: int, arch: Arch, w: LayerWeights, compute: str, path: Path, split5: bool = True) -> int:
    """Write layer_J.onnx and its data file; returns the parameter bytes held (`split5`: 5-bit
    codes as 4 + 2 bits, else in 8-bit storage)."""
    data = DataFile(path.with_suffix(".onnx.data"))
    g = Graph(f"layer_{j}", data)
    a, pre = arch, f"/model/layers.{j}"
    f32, i32 = TensorProto.FLOAT, TensorProto.INT32
    kv_shape: list[int | str] = ["batch", a.kv_heads, "cap", a.head_dim]
    h = g.input(f"hidden_{j}", f32, ["batch", "seq", a.hidden])
    g.input(f"past_key_{j}", f32, kv_shape)
    g.input(f"past_value_{j}", f32, kv_shape)
    g.input("seqlens_k", i32, ["batch"])
    g.input("total_seq", i32, [])
    rope = "_local" if a.local_rope and a.window(j) else ""
    window = {"local_window_size": a.window(j)} if a.window(j) else {}
    rot = (a.rotary_dim or a.head_dim) // 2
    g.input(f"cos_cache{rope}", f32, ["positions", rot])
    g.input(f"sin_cache{rope}", f32, ["positions", rot])
    lin = Linears(g, compute, split5)
    x = _rms(g, h, w.ln1, a.eps, f"{pre}/input_layernorm", f"{pre}.input_layernorm.weight")
    attn_in = _qkv(g, lin, x, w, a, pre)
    attn = g.node("GroupQueryAttention",
                  [*attn_in, f"past_key_{j}", f"past_value_{j}", "seqlens_k", "total_seq",
                   f"cos_cache{rope}", f"sin_cache{rope}"],
                  [f"{pre}/attn/output", f"present_key_{j}", f"present_value_{j}"],
                  f"{pre}/attn/GroupQueryAttention", MS, num_heads=a.heads,
                  kv_num_heads=a.kv_heads, scale=a.attn_scale or 1 / math.sqrt(a.head_dim),
                  do_rotary=1, rotary_interleaved=0, **window)[0]
    o = lin(attn, w.o, f"{pre}/attn/o_proj", a.heads * a.head_dim)
    if w.attn_out_norm is not None:
        o = _rms(g, o, w.attn_out_norm, a.eps, f"{pre}/attn/out_norm")
    x2, _, _, resid = g.node("SkipSimplifiedLayerNormalization",  # (the norm before the MLP)
                             [o, h, g.init(f"{pre}.post_attention_layernorm.weight", w.ln2)],
                             [f"{pre}/post_attention_layernorm/output", "", "",
                              f"{pre}/post_attention_layernorm/residual"],
                             f"{pre}/post_attention_layernorm", MS, epsilon=a.eps)
    down = _mlp(g, lin, x2, w, a, pre)
    if w.mlp_out_norm is not None:
        down = _rms(g, down, w.mlp_out_norm, a.eps, f"{pre}/mlp/out_norm")
    g.node("Add", [down, resid], [f"hidden_{j + 1}"], f"{pre}/residual/Add")
    g.output(f"hidden_{j + 1}", f32, ["batch", "seq", a.hidden])
    g.output(f"present_key_{j}", f32, kv_shape)
    g.output(f"present_value_{j}", f32, kv_shape)
    g.save(path)
    data.close()
    return g.param_bytes


def _rms(g: Graph, x: str, scale: np.ndarray, eps: float, name: str, weight: str = "") -> str:
    return g.node("SimplifiedLayerNormalization", [x, g.init(weight or f"{name}.weight", scale)], 1,
                  name, axis=-1, epsilon=eps, stash_type=1)[0]


def _qkv(g: Graph, lin: Linears, x: str, w: LayerWeights, a: Arch, pre: str) -> list[str]:
    """GroupQueryAttention's query, key and value inputs: one packed projection (key and value
    then empty) unless q and k are normed per head first."""
    qkv = _pack([w.q, w.k, w.v])
    if w.q_norm is None:
        if qkv is not None:
            return [lin(x, qkv, f"{pre}/attn/qkv_proj", a.hidden), "", ""]
        return [lin(x, p, f"{pre}/attn/{n}_proj", a.hidden) for n, p in (("q", w.q), ("k", w.k), ("v", w.v))]
    if qkv is not None:
        sizes = g.init(f"{pre}/attn.qkv_split", np.array([a.heads * a.head_dim, a.kv_heads * a.head_dim,
                                                          a.kv_heads * a.head_dim], np.int64))
        q, k, v = g.node("Split", [lin(x, qkv, f"{pre}/attn/qkv_proj", a.hidden), sizes], 3,
                         f"{pre}/attn/Split", axis=-1)
    else:
        q, k, v = (lin(x, p, f"{pre}/attn/{n}_proj", a.hidden)
                   for n, p in (("q", w.q), ("k", w.k), ("v", w.v)))
    assert w.k_norm is not None
    return [_head_norm(g, q, w.q_norm, a, a.heads, f"{pre}/attn/q_norm"),
            _head_norm(g, k, w.k_norm, a, a.kv_heads, f"{pre}/attn/k_norm"), v]


def _head_norm(g: Graph, x: str, scale: np.ndarray, a: Arch, heads: int, name: str) -> str:
    """An RMS norm over each head's head_dim values: (batch, seq, heads * head_dim)."""
    split = g.init(f"{name}.heads", np.array([0, 0, heads, a.head_dim], np.int64))
    whole = g.init(f"{name}.flat", np.array([0, 0, heads * a.head_dim], np.int64))
    x = g.node("Reshape", [x, split], 1, f"{name}/Reshape")[0]
    x = _rms(g, x, scale, a.eps, name)
    return g.node("Reshape", [x, whole], 1, f"{name}/Flatten")[0]


def _mlp(g: Graph, lin: Linears, x: str, w: LayerWeights, a: Arch, pre: str) -> str:
    gu = _pack([w.gate, w.up])
    if gu is not None:
        both = lin(x, gu, f"{pre}/mlp/gate_up_proj", a.hidden)
        split = g.init(f"{pre}/mlp.split", np.array([a.intermediate, a.intermediate], np.int64))
        gate, up = g.node("Split", [both, split], 2, f"{pre}/mlp/Split", axis=-1)
    else:
        gate = lin(x, w.gate, f"{pre}/mlp/gate_proj", a.hidden)
        up = lin(x, w.up, f"{pre}/mlp/up_proj", a.hidden)
    if a.act == "gelu_tanh":
        act = g.node("FastGelu", [gate], 1, f"{pre}/mlp/act/FastGelu", MS)[0]
    else:
        sig = g.node("Sigmoid", [gate], 1, f"{pre}/mlp/act/Sigmoid")[0]
        act = g.node("Mul", [gate, sig], 1, f"{pre}/mlp/act/Mul")[0]
    act = g.node("Mul", [act, up], 1, f"{pre}/mlp/Mul")[0]
    return lin(act, w.down, f"{pre}/mlp/down_proj", a.intermediate)


def embed(arch: Arch, table: np.ndarray | Blocks, data: DataFile, path: Path,
          halves: bool = False) -> int:
    """embed.onnx: a Gather (float table) or GatherBlockQuantized (blocks; with `halves`, an
    8-bit table as its two 4-bit halves, the bytes an exact head takes: `halves_head`)."""
    g = Graph("embed", data)
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    out = "hidden_0" if arch.embed_scale == 1.0 else "/model/embed_tokens/output"
    if isinstance(table, np.ndarray):
        g.node("Gather", [g.init("/model/embed_tokens.weight", table), ids], [out],
               "/model/embed_tokens/Gather", axis=0)
    elif halves and table.halves_apply:  # hi rows + lo rows
        parts = []
        for half, scales, label in zip(table.halves(), _half_scales(g, table, "/model/embed_tokens"),
                                       ("hi", "lo"), strict=True):
            ins = [g.init(f"/model/embed_tokens.{label}.qweight", half.gather_data()), ids, scales]
            zp = half.zero_points()
            if zp is not None:
                ins.append(g.init(f"/model/embed_tokens.{label}.zero_points", zp))
            parts += g.node("GatherBlockQuantized", ins, 1,
                            f"/model/embed_tokens/{label}/GatherBlockQuantized", MS, bits=4,
                            block_size=table.block, gather_axis=0, quantize_axis=1)
        g.node("Add", parts, [out], "/model/embed_tokens/Add")
    else:
        lin = Linears(g, "fast")
        scales = lin._matrix(table.scale_factored, table.scale, table.scale_fp16,
                             "/model/embed_tokens.scales")
        n, k = table.shape  # (the table stored once with a tied head's: the same codes)
        ins = [lin.codes(table, "/model/embed_tokens.qweight", (n, k * table.bits // 8)), ids, scales]
        if not table.default_zero:
            ins.append(g.init("/model/embed_tokens.zero_points", table.zero_points() if table.bits == 4
                              else table.zero))  # type: ignore[arg-type]
        rows = out if table.minimum is None else "/model/embed_tokens/rows"
        g.node("GatherBlockQuantized", ins, [rows], "/model/embed_tokens/GatherBlockQuantized",
               MS, bits=table.bits, block_size=table.block, gather_axis=0, quantize_axis=1)
        if table.minimum is not None:  # + the block's minimum, spread over its columns
            nb = table.shape[1] // table.block
            mins = lin._matrix(table.minimum_factored, table.minimum, table.minimum_fp16,
                               "/model/embed_tokens.minima")
            m = g.node("Gather", [mins, ids], 1, "/model/embed_tokens/minima/Gather", axis=0)[0]
            m = g.node("Unsqueeze", [m, g.init("/model/embed_tokens.axis", np.array([-1], np.int64))],
                       1, "/model/embed_tokens/minima/Unsqueeze")[0]
            ones = g.init("/model/embed_tokens.ones", np.ones((1, 1, nb, table.block), np.float32))
            m = g.node("Mul", [m, ones], 1, "/model/embed_tokens/minima/Expand")[0]
            shape = g.init("/model/embed_tokens.shape", np.array([0, 0, arch.hidden], np.int64))
            m = g.node("Reshape", [m, shape], 1, "/model/embed_tokens/minima/Reshape")[0]
            g.node("Add", [rows, m], [out], "/model/embed_tokens/minima/Add")
    if out != "hidden_0":  # scaled embeddings (Gemma: by sqrt(hidden), in float32)
        scale = g.init("/model/embed_tokens.scale", np.array(arch.embed_scale, np.float32))
        g.node("Mul", [out, scale], ["hidden_0"], "/model/embed_tokens/Mul")
    g.output("hidden_0", TensorProto.FLOAT, ["batch", "seq", arch.hidden])
    g.save(path)
    return g.param_bytes


def exact_rows(weight: Blocks, data: DataFile) -> dict[str, object] | None:
    """Where a block head's rows are in the data file, so that the runtime can rescore the
    best candidates of a fast (int8-activation) head exactly (engine/runtime.py). None for
    forms it cannot read (minima)."""
    if weight.minimum is not None or not np.all(weight.zero == weight.zero.flat[0]):
        return None
    found = weight.narrow
    (q_off, q_len) = data.put(weight.gather_data() if found is None else found[0])
    spec: dict[str, object] = {"file": data.path.name, "rows": weight.shape[0], "cols": weight.shape[1],
                               "bits": weight.bits, "block": weight.block,
                               "zero": int(weight.zero.flat[0]), "qweight": [q_off, q_len]}
    if found is not None:  # the codes at their own width (the head's products read the same bytes)
        spec |= {"code_width": found[1], "code_low": found[2]}
    f = weight.scale_factored
    if f is not None:  # float16 per super-block x int8 per block, as the data file has them
        (b_off, b_len), (m_off, m_len) = data.put(f.base), data.put(f.mult)
        return spec | {"scale_base": [b_off, b_len, "float16"],
                       "scale_mult": [m_off, m_len, f.mult.dtype.name],
                       "scale_factor": f.sign * f.factor}
    scales = weight.scale.astype(np.float16 if weight.scale_fp16 else np.float32)
    s_off, s_len = data.put(scales)
    return spec | {"scales": [s_off, s_len, scales.dtype.name]}


def head(arch: Arch, norm: np.ndarray, weight: np.ndarray | Blocks, compute: str, data: DataFile,
         path: Path) -> int:
    """head.onnx: final RMS norm and the vocabulary projection (the embedding table itself when
    the model ties them: written once in the shared data file). It also outputs the normed
    hidden state (`normed`), which exact rescoring of a fast head takes."""
    g = Graph("head", data)
    h = g.input("hidden", TensorProto.FLOAT, ["batch", "seq", arch.hidden])
    x = g.node("SimplifiedLayerNormalization", [h, g.init("/model/norm.weight", norm)], ["normed"],
               "/model/norm", axis=-1, epsilon=arch.eps, stash_type=1)[0]
    g.output("normed", TensorProto.FLOAT, ["batch", "seq", arch.hidden])
    if isinstance(weight, np.ndarray):  # (vocab, hidden), as the embedding keeps it
        wt = g.node("Transpose", [g.init("/lm_head.weight", weight)], 1, "/lm_head/Transpose",
                    perm=[1, 0])[0]  # folded when the session loads
        g.node("MatMul", [x, wt], ["logits"], "/lm_head/MatMul")
    elif halves_head(weight, compute):
        hi, lo = weight.halves()
        products = []
        for half, scales, label in zip((hi, lo), _half_scales(g, weight, "/lm_head"), ("hi", "lo"),
                                       strict=True):
            ins = [x, g.init(f"/lm_head.{label}.qweight", half.packed()), scales]
            zp = half.zero_points()
            if zp is not None:
                ins.append(g.init(f"/lm_head.{label}.zero_points", zp))
            products += g.node("MatMulNBits", ins, 1, f"/lm_head/{label}/MatMulNBits", MS,
                               K=arch.hidden, N=weight.shape[0], bits=4, block_size=half.block,
                               accuracy_level=0)
        g.node("Add", products, ["logits"], "/lm_head/Add")
    else:
        y = Linears(g, compute)(x, Linear(weight), "/lm_head", arch.hidden)
        g.node("Identity", [y], ["logits"], "/lm_head/Identity")
    g.output("logits", TensorProto.FLOAT, ["batch", "seq", arch.vocab])
    g.save(path)
    return g.param_bytes


def halves_head(weight: np.ndarray | Blocks, compute: str) -> bool:
    """Whether head() writes the vocabulary projection as the two 4-bit halves of an 8-bit
    table (Blocks.halves): in exact mode, where 8-bit products run as two 4-bit ones anyway
    (the fast float kernel is 4-bit only); the embedding then stores the same halves, so a tied
    table is on disk once. (Fast mode keeps the 8-bit product and the 8-bit embedding.)"""
    return compute == "exact" and isinstance(weight, Blocks) and weight.halves_apply


def _half_scales(g: Graph, table: Blocks, name: str) -> tuple[str, str]:
    """The scales of an 8-bit table's hi and lo halves (16d and d), d stored once."""
    lo = Linears(g, "exact")._scales(table.scale, table.scale_fp16, f"{name}.scales")
    hi = g.node("Mul", [lo, g.init(f"{name}.sixteen", np.array(16, np.float32))], 1,
                f"{name}/hi_scales/Mul")[0]
    return hi, lo
