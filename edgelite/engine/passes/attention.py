"""Attention over the valid KV, in place of GroupQueryAttention: edgelite's own operator,
or plain onnxruntime operators.

A joined range's GroupQueryAttention nodes are rewritten as a session loads (no re-export):

- with the kernel (`use_kernel`: the session registers engine/kernels' library), one
  `edgelite` Attend (float32 KV), Attend16 (float16) or Attend8 (int8) node a layer does it all
  (see engine/kernels/src/ops.c): it takes the step's queries, keys and values, the slot's K and V (bound in
  place), the step's total and the rotary tables, turns the queries and keys, writes the
  step's rows into the slot and gives the attention output. One operator a layer: the
  rotations, casts and writes below take eight more, and onnxruntime's time between operators
  is a share of a decode step;
- without it, the step's new keys and values are rotated (the `RotaryEmbedding` contrib op,
  as GroupQueryAttention rotates them), cast to the KV dtype and written into the session's
  KV slot by a ScatterND whose output is bound to the same buffer as its input (onnxruntime
  writes the rows in place and copies nothing else); attention then reads only the slot's
  valid positions (a Slice up to the step's total, from the window's first position on
  windowed layers), widened to float32 where the KV is float16; the query rows of each KV
  head's group are one matrix product against that head's keys (`G x n` rows), a causal (and
  window) mask is added, Softmax, and one product with the values.

The plain operators serve a 16-bit KV where there is no kernel (onnxruntime's CPU
GroupQueryAttention reads one only with 16-bit queries). Every position comes out the same
decoded, in any chunking, after a KV store restore or a rollback: every product has at least
two rows (a KV head's query group; a model whose groups are one head each runs its rows
twice), onnxruntime's float MatMul gives each row the same result whatever the number of
rows, and a masked position adds exactly nothing. Without the kernel a float32 KV keeps
GroupQueryAttention (engine/passes/invariant.py pads its one-row steps): measured on SmolLM2, these
operators decode at about its speed and faster at long contexts, but a prompt chunk
materialises its scores, mask sum and probabilities whole, so prefill takes 1.3-2.2x as long
(scripts/bench_context.py, docs/benchmarks.md).

The shape arithmetic (the step's rows from the hidden input, its positions from
`total_seq`) is in the graph and shared by the range's layers, so one session serves decode
steps and prompt chunks alike. With the kernel a step may hold several sessions' rows (a batch:
each its own KV slot and total, each computed as alone); the plain operators' rewrite is batch 1.
"""

from __future__ import annotations

from edgelite.engine import kernels
from edgelite.engine.onnxgraph import (
    DIM_VALUE,
    FLOAT,
    FLOAT16,
    GRAPH_INIT,
    GRAPH_INPUT,
    GRAPH_NODE,
    GRAPH_OUTPUT,
    INT8,
    INT64,
    SHAPE_DIM,
    TENSOR_ELEM,
    TENSOR_SHAPE,
    TYPE_TENSOR,
    VALUE_TYPE,
    Field,
    each_node,
    encode,
    fields,
    hidden_input,
    make_node,
    make_tensor,
    node_attrs,
    value_name,
)
from edgelite.engine.passes.base import Pass, apply
from edgelite.errors import ModelFileError

ELEM = {"float32": FLOAT, "float16": FLOAT16, "int8": INT8}
MS = "com.microsoft"
KERNEL_OPS = {"float32": "Attend", "float16": "Attend16", "int8": "Attend8"}  # (engine/kernels)
P = "edgelite_attn"  # names of what the rewrite adds
# a windowed layer reads its keys from a multiple of this many positions on (the window's
# start rounded down): every position then sits at the same place within the products' and
# the Softmax's blocks (onnxruntime's float MatMul sums K in blocks of 256) whatever the step
WINDOW_ALIGN = 256


def _node(op: str, inputs: list[str], outputs: list[str], name: str, domain: str = "",
          **attrs: int | float | list[int]) -> Field:
    return GRAPH_NODE, 2, make_node(op, inputs, outputs, name, domain, **attrs)


def attention_pass(head_dim: int, rotary_dim: int, kv_dtype: str = "float32", use_kernel: bool = False,
                   threads: int = 1) -> Pass:
    """The pass that rewrites a joined range's GroupQueryAttention (see the module's text); its
    KV inputs and outputs of `kv_dtype`. `use_kernel`: attention by edgelite's operator (the
    session must register engine/kernels' library), a prompt chunk's on up to `threads`
    threads; else onnxruntime's plain operators over the valid KV."""
    if kv_dtype not in ELEM:
        raise ModelFileError(f"KV dtype {kv_dtype!r}: one of {', '.join(ELEM)}")
    return Pass("attend-kernel" if use_kernel else "attend-plain",
                _Rewrite(head_dim, rotary_dim, kv_dtype, use_kernel, threads).graph,
                "cannot rewrite the range's attention", ours=use_kernel)


def plain_attention(model: bytes, head_dim: int, rotary_dim: int, kv_dtype: str = "float32",
                    use_kernel: bool = False, threads: int = 1) -> bytes:
    """The model with `attention_pass` run over it."""
    return apply(model, [attention_pass(head_dim, rotary_dim, kv_dtype, use_kernel, threads)])


class _Rewrite:
    def __init__(self, head_dim: int, rotary_dim: int, kv_dtype: str, use_kernel: bool, threads: int) -> None:
        self.d, self.rot, self.kv_dtype, self.kernel = head_dim, rotary_dim, kv_dtype, use_kernel
        self.threads = threads
        self.consts: dict[str, Field] = {}
        self.shared: list[Field] = []
        self.masks: dict[int, tuple[str, str]] = {}  # window -> (mask, first)
        self.tiled: dict[str, str] = {}  # masks repeated for a query group
        self.kv_names: set[str] = set()

    def const(self, name: str, kind: int, values: list[float], dims: list[int]) -> str:
        full = f"{P}/c/{name}"
        if full not in self.consts:
            self.consts[full] = (GRAPH_INIT, 2, make_tensor(full, kind, values, dims))
        return full

    def ints(self, *values: int) -> str:
        return self.const("i" + "_".join(str(v) for v in values).replace("-", "m"), INT64,
                          list(values), [len(values)])

    def graph(self, graph: bytes) -> bytes:
        items: list[Field] = []
        total = ""
        count = 0
        hidden = hidden_input(graph)
        for field, node in each_node(graph, "GroupQueryAttention"):
            if node is None:
                items.append(field)
                continue
            inputs, outputs, rest = node
            if not hidden:
                raise ValueError("the range has no hidden_* input")
            if not total:
                total = inputs[6]
                self._positions(hidden, total, inputs[5])
            count += 1
            items += self._layer(count, inputs, outputs, node_attrs(rest))
        if not count:
            return graph
        items = [self._retyped(n, w, v) for n, w, v in items]
        return encode([*self.shared, *items, *self.consts.values()])

    def _retyped(self, number: int, wire: int, value: bytes | int) -> Field:
        """A KV input or output declared of the KV dtype (int8: rows of head_dim + 1)."""
        if number not in (GRAPH_INPUT, GRAPH_OUTPUT) or self.kv_dtype == "float32" \
                or value_name(value) not in self.kv_names:  # type: ignore[arg-type]
            return number, wire, value
        info: list[Field] = []
        for n, w, v in fields(value):  # type: ignore[arg-type]
            if n == VALUE_TYPE:
                typ = []
                for tn, tw, tv in fields(v):  # type: ignore[arg-type]
                    if tn == TYPE_TENSOR:
                        tv = encode([(en, ew, ELEM[self.kv_dtype] if en == TENSOR_ELEM
                                      else self._row_width(ev) if en == TENSOR_SHAPE else ev)  # type: ignore[arg-type]
                                     for en, ew, ev in fields(tv)])  # type: ignore[arg-type]
                    typ.append((tn, tw, tv))
                v = encode(typ)
            info.append((n, w, v))
        return number, wire, encode(info)

    def _row_width(self, shape: bytes) -> bytes:
        """A KV shape's last dimension (head_dim) as the KV dtype's row width."""
        if self.kv_dtype != "int8":
            return shape
        dims = [(n, w, v) for n, w, v in fields(shape)]
        last = max(i for i, (n, _, _) in enumerate(dims) if n == SHAPE_DIM)
        n, w, v = dims[last]
        dims[last] = n, w, encode([(dn, dw, self.d + 2 if dn == DIM_VALUE else dv)
                                   for dn, dw, dv in fields(v)])  # type: ignore[arg-type]
        return encode(dims)

    def _add(self, op: str, inputs: list[str], out: str, domain: str = "", **attrs: int | list[int]) -> str:
        self.shared.append(_node(op, inputs, [out], out, domain, **attrs))
        return out

    def _positions(self, hidden: str, total_seq: str, seqlens: str) -> None:
        """Shared: the total T after the step (with the kernel, each session's of a batch:
        seqlens_k + 1, the same as total_seq for one session); without the kernel also the
        step's rows n and its positions pos (n) (the ScatterND indices are made per KV head
        count: _indices)."""
        a = self._add
        if self.kernel:  # (the operator finds the step's positions itself)
            self.total = a("Add", [a("Cast", [seqlens], f"{P}/seqlens64", to=INT64), self.ints(1)],
                           f"{P}/totals")
            return
        total = a("Cast", [a("Reshape", [total_seq, self.ints(1)], f"{P}/total32")], f"{P}/total", to=INT64)
        self.total = total
        shape = a("Shape", [hidden], f"{P}/shape")
        self.n = a("Slice", [shape, self.ints(1), self.ints(2)], f"{P}/n")  # (1,)
        start = a("Sub", [total, self.n], f"{P}/start")
        self.start = start
        self.total_s = a("Squeeze", [total, self.ints(0)], f"{P}/total_s")
        start_s = a("Squeeze", [start, self.ints(0)], f"{P}/start_s")
        one = self.const("one", INT64, [1], [])
        self.pos = a("Range", [start_s, self.total_s, one], f"{P}/pos")  # (n,)
        self.pos_ids = a("Unsqueeze", [self.pos, self.ints(0)], f"{P}/pos_ids")  # (1, n)
        self.pos_col = a("Unsqueeze", [self.pos, self.ints(1)], f"{P}/pos_col")  # (n, 1)
        self.indices: dict[int, str] = {}

    def _indices(self, kv_heads: int) -> str:
        """ScatterND indices (n, kv_heads, 3): (0, head, position) of each new row, in the
        order the projection gives them (position, head), so the rows need no transpose."""
        if kv_heads in self.indices:
            return self.indices[kv_heads]
        a, t = self._add, f"{P}/idx{kv_heads}"
        heads = self.const(f"heads{kv_heads}", INT64, list(range(kv_heads)), [1, kv_heads])
        zero = self.const("zero", INT64, [0], [])
        hz = a("Mul", [heads, zero], f"{t}/hz")  # (1, kv_heads) zeros
        pz = a("Mul", [self.pos_col, zero], f"{t}/pz")  # (n, 1) zeros
        p = a("Add", [hz, self.pos_col], f"{t}/p")  # (n, kv_heads)
        h = a("Add", [heads, pz], f"{t}/h")  # (n, kv_heads)
        b = a("Mul", [h, zero], f"{t}/b")
        cols = [a("Unsqueeze", [x, self.ints(-1)], f"{t}/{x.rsplit('/', 1)[1]}3") for x in (b, h, p)]
        self.indices[kv_heads] = a("Concat", cols, t, axis=-1)  # (n, kv_heads, 3)
        return self.indices[kv_heads]

    def _mask(self, window: int) -> tuple[str, str]:
        """(mask, first): the additive mask (n, T'), 0 where a row may attend and -inf where
        not, over the key positions first..T-1 that attention reads (a windowed layer's first
        is its window's start, rounded down to WINDOW_ALIGN)."""
        if window in self.masks:
            return self.masks[window]
        a, t = self._add, f"{P}/mask_w{window}"
        first = self.ints(0)
        if window > 0:
            lo = a("Max", [a("Sub", [self.start, self.ints(window - 1)], f"{t}/lo"), self.ints(0)],
                   f"{t}/lo0")
            align = self.ints(WINDOW_ALIGN)
            first = a("Mul", [a("Div", [lo, align], f"{t}/blocks"), align], f"{t}/first")
        first_s = a("Squeeze", [first, self.ints(0)], f"{t}/first_s")
        one = self.const("one", INT64, [1], [])
        keys = a("Range", [first_s, self.total_s, one], f"{t}/keys")
        row = a("Unsqueeze", [keys, self.ints(0)], f"{t}/key_row")  # (1, T')
        masked = a("Less", [self.pos_col, row], f"{t}/future")  # (n, T'): key after the row
        if window > 0:
            # (a window of w: the row's own position and the w - 1 before it, as
            # GroupQueryAttention's local_window_size and transformers' sliding window)
            edge = a("Sub", [self.pos_col, self.ints(window - 1)], f"{t}/edge")
            far = a("Less", [row, edge], f"{t}/far")
            masked = a("Or", [masked, far], f"{t}/masked")
        neg = self.const("neg_inf", FLOAT, [float("-inf")], [])
        zero_f = self.const("zero_f", FLOAT, [0.0], [])
        mask = a("Where", [masked, neg, zero_f], f"{t}/add")
        self.masks[window] = (mask, first)
        return self.masks[window]

    def _tiled(self, window: int, copies: int) -> tuple[str, str]:
        """(mask, first) with the mask repeated for `copies` query heads: (copies * n, T'),
        rows ordered (head, row) as a KV head's query group is (made once per step)."""
        mask, first = self._mask(window)
        if copies > 1:
            key = f"{P}/mask_w{window}_x{copies}"
            if key not in self.tiled:
                self.tiled[key] = self._add("Tile", [mask, self.ints(copies, 1)], key)
            mask = self.tiled[key]
        return mask, first

    def _layer(self, i: int, inputs: list[str], outputs: list[str],
               attrs: dict[str, int | float]) -> list[Field]:
        heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
        if heads % kv_heads:
            raise ValueError(f"{heads} heads in {kv_heads} KV groups")
        if attrs.get("softcap", 0.0) or attrs.get("smooth_softmax", 0) or attrs.get("rotary_interleaved", 0):
            raise ValueError("softcap, smooth softmax and interleaved rotary are not supported")
        d, g = self.d, heads // kv_heads
        window = int(attrs.get("local_window_size", -1))
        scale = float(attrs.get("scale", 0.0)) or d ** -0.5
        t = f"{P}/{i}"
        nodes: list[Field] = []

        def a(op: str, ins: list[str], name: str, domain: str = "", **kw: int | list[int]) -> str:
            out = f"{t}/{name}"
            nodes.append(_node(op, ins, [out], out, domain, **kw))
            return out

        q, k, v = inputs[0], inputs[1], inputs[2]
        past_k, past_v = inputs[3], inputs[4]
        present_k, present_v = outputs[1], outputs[2]
        self.kv_names |= {past_k, past_v, present_k, present_v}
        if not k:  # packed
            q, k, v = (f"{t}/{x}" for x in ("q", "k", "v"))
            nodes.append(_node("Split", [inputs[0], self.ints(heads * d, kv_heads * d, kv_heads * d)],
                               [q, k, v], f"{t}/split", axis=-1))
        if self.kernel:
            tables = [inputs[7], inputs[8]] if int(attrs.get("do_rotary", 0)) else []
            nodes.append(_node(KERNEL_OPS[self.kv_dtype], [q, k, v, past_k, past_v, self.total, *tables],
                               [outputs[0], present_k, present_v], f"{t}/attend", kernels.DOMAIN,
                               num_heads=heads, kv_num_heads=kv_heads, local_window_size=window, scale=scale,
                               threads=self.threads))
            return nodes
        if int(attrs.get("do_rotary", 0)):
            cos, sin = inputs[7], inputs[8]
            q = a("RotaryEmbedding", [q, self.pos_ids, cos, sin], "q_rot", MS, num_heads=heads,
                  rotary_embedding_dim=self.rot, interleaved=0)
            k = a("RotaryEmbedding", [k, self.pos_ids, cos, sin], "k_rot", MS, num_heads=kv_heads,
                  rotary_embedding_dim=self.rot, interleaved=0)
        index = self._indices(kv_heads)
        present = {}
        for kind, new, past, out in (("k", k, past_k, present_k), ("v", v, past_v, present_v)):
            new = a("Reshape", [new, self.ints(-1, kv_heads, d)], f"{kind}_rows")  # (n, kv, d)
            if self.kv_dtype != "float32":
                new = a("Cast", [new], f"{kind}_stored", to=ELEM[self.kv_dtype])
            nodes.append(_node("ScatterND", [past, index, new], [out], f"{t}/{kind}_write"))
            present[kind] = out
        if self.kv_dtype == "int8":
            raise ValueError("an int8 KV needs the attention kernel")
        rows = max(g, 2)  # (a group of one query head runs twice: two rows a product)
        mask, first = self._tiled(window, rows)
        valid = {}
        for kind, x in present.items():
            x = a("Slice", [x, first, self.total, self.ints(2)], f"{kind}_valid")  # (1, kv, T', d)
            if self.kv_dtype != "float32":
                x = a("Cast", [x], f"{kind}_wide", to=FLOAT)
            valid[kind] = x
        # queries (1, n, heads * d) -> (1, kv_heads, g * n, d), rows ordered (head in group, row)
        qs = a("Mul", [q, self.const(f"scale{i}", FLOAT, [scale], [])], "q_scaled")
        qs = a("Transpose", [a("Reshape", [qs, self.ints(-1, kv_heads, g, d)], "q_4d")], "q_grouped",
               perm=[1, 2, 0, 3])
        qs = a("Reshape", [qs, self.ints(1, kv_heads, -1, d)], "q_rows")
        if g == 1:
            qs = a("Concat", [qs, qs], "q_twice", axis=2)
        kt = a("Transpose", [valid["k"]], "k_t", perm=[0, 1, 3, 2])  # (1, kv, d, T')
        scores = a("MatMul", [qs, kt], "scores")  # (1, kv, rows * n, T')
        probs = a("Softmax", [a("Add", [scores, mask], "masked")], "probs", axis=-1)
        o = a("MatMul", [probs, valid["v"]], "context")  # (1, kv, rows * n, d)
        if g == 1:
            o = a("Slice", [o, self.ints(0), self.n, self.ints(2)], "context_once")
        o = a("Transpose", [a("Reshape", [o, self.ints(kv_heads, g, -1, d)], "context_4d")],
              "context_rows", perm=[2, 0, 1, 3])  # (n, kv, g, d)
        nodes.append(_node("Reshape", [o, self.ints(1, -1, heads * d)], [outputs[0]], f"{t}/output"))
        return nodes

