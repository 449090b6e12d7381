"""Steps on the wire: the body of a Forward or Result frame as a fixed binary header and the
tensor's raw bytes (every other message is a msgpack map; frames.py picks the codec).

A step crosses every hop of a plan, and the Python that encodes and checks it runs right after
the layers have streamed the weights through the CPU caches: measured cold, a msgpack Forward
took 136 us to pack and 102 us to parse and check, this layout 75-100 us each (on the build
VM a cold Python call alone costs 5-30 us, so fewer calls is what counts). The body of a
step frame starts with 0xC1, a byte msgpack never uses, so a receiver tells the two apart by
the first byte; a msgpack Forward is still accepted (and checked by the schema).

Body layout (little-endian):
  magic 0xC1, kind (1 forward, 2 result), flags (1: hidden, 2: error), trace length,
  step u64, start u32, plan_id length u8, session length u8, error length u16,
  dtype code u8, rank u8, 2 bytes of padding                            (24 bytes)
  plan_id, session, error (UTF-8), rank x u32 dims, trace x (u32, u32),
  padding to a multiple of 4, then the tensor's bytes (exactly shape x dtype).
Every length, range and size is checked against the protocol's bounds (messages.py) and the
wire limits before anything is built; a frame that breaks one is a ProtocolError naming it.
"""

from __future__ import annotations

import math
import struct
import time

import numpy as np

from edgelite.config import WireLimits
from edgelite.errors import ProtocolError
from edgelite.net import messages as m
from edgelite.net.schema import Message
from edgelite.net.tensors import DTYPES

MAGIC = 0xC1
KINDS: dict[int, type[m.Forward] | type[m.Result]] = {1: m.Forward, 2: m.Result}
CODES = {cls: k for k, cls in KINDS.items()}
DTYPE_NAMES = tuple(DTYPES)  # dtype code -> name
CODE = {name: i for i, name in enumerate(DTYPE_NAMES)}
CODE_OF = {np.dtype(DTYPES[name]): i for i, name in enumerate(DTYPE_NAMES)}  # (dtype.name is slow)
ITEMSIZE = tuple(np.dtype(DTYPES[name]).itemsize for name in DTYPE_NAMES)
PAD = (0, 3, 2, 1)  # bytes that bring a length = 0, 1, 2, 3 (mod 4) to a multiple of 4
HIDDEN, ERROR = 1, 2
HEAD = struct.Struct("<BBBBQIBBHBBxx")
LEN = struct.Struct(">I")  # a frame's length prefix (frames.py)
DIMS = struct.Struct("<3I")  # a (batch, seq, hidden) shape
PAIR = struct.Struct("<2I")  # one stage's trace entry
F32 = CODE["float32"]
U32 = 2**32 - 1
MAX_ERROR_BYTES = 4 * m.MAX_ERROR  # UTF-8: at most 4 bytes a character


def carries(msg: Message) -> bool:
    """Whether this codec encodes the message (a step)."""
    return type(msg) in CODES


def encode(step: m.Forward | m.Result) -> bytes:
    """The frame body of a step."""
    return encode_fields(CODES[type(step)], step.plan_id, step.session, step.step, step.start,
                         step.hidden, step.error, step.trace)


def encode_fields(kind: int, plan_id: str, session: str, step: int, start: int,
                  hidden: np.ndarray | None, error: str | None = None,
                  trace: list[tuple[int, int]] | tuple[()] = ()) -> bytes:
    """A step's frame body from its fields (kind: 1 forward, 2 result), with no message
    object built. (The hot path of every hop: few lines, run cold.)"""
    plan, sess = plan_id.encode(), session.encode()
    err = b"" if error is None else error.encode()
    if hidden is None:
        dims, data, code = (), b"", 0
    else:
        dims, data, code = hidden.shape, hidden.tobytes(), CODE_OF[hidden.dtype]
    flat = [min(max(v, 0), U32) for pair in trace for v in pair]
    pad = PAD[(len(plan) + len(sess) + len(err)) % 4]
    var = struct.pack(f"<{len(plan)}s{len(sess)}s{len(err)}s{len(dims)}I{len(flat)}I{pad}x",
                      plan, sess, err, *dims, *flat)
    flags = (0 if hidden is None else HIDDEN) | (0 if error is None else ERROR)
    return b"".join((HEAD.pack(MAGIC, kind, flags, len(trace), step, start,
                               len(plan), len(sess), len(err), code, len(dims)), var, data))


def is_step(body: bytes | bytearray | memoryview) -> bool:
    return len(body) > 0 and body[0] == MAGIC


def parse(body: bytes | bytearray | memoryview, limits: WireLimits) -> m.Forward | m.Result:
    """A binary step frame's body as its message (the tensor copied out of the frame), or a
    ProtocolError naming what is wrong. (The hot path: one check of the whole header; the
    error's wording is worked out only for a frame that fails it.)"""
    size = len(body)
    if size < HEAD.size:
        raise ProtocolError(f"step frame: {size} bytes, shorter than its {HEAD.size}-byte header")
    head = HEAD.unpack_from(body)
    _, kind, flags, n_trace, step, start, n_plan, n_session, n_error, code, rank = head
    n_ints = rank + 2 * n_trace
    pos = HEAD.size + n_plan + n_session + n_error + 4 * n_ints
    pos += -pos % 4
    if (kind not in KINDS or flags > 3 or n_trace >= m.MAX_STAGES or step > m.RID
            or start > m.MAX_START or n_plan > m.ID or n_session > m.ID or n_error > MAX_ERROR_BYTES
            or rank > limits.max_tensor_dims or code >= len(DTYPE_NAMES) or pos > size
            or (n_error > 0) != (flags & ERROR > 0) or (not flags & HIDDEN and (rank or code))):
        raise _header_error(head, size, limits)
    texts = struct.unpack_from(f"<{n_plan}s{n_session}s{n_error}s{n_ints}I", body, HEAD.size)
    try:
        plan, session = texts[0].decode(), texts[1].decode()
        error = texts[2].decode() if flags & ERROR else None
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"{KINDS[kind].TYPE}: an id or the error is not UTF-8") from exc
    dims, hidden = texts[3:3 + rank], None
    if flags & HIDDEN:
        dtype = DTYPES[DTYPE_NAMES[code]]
        count = math.prod(dims)
        # each size too (a 0 among huge ones makes 0 elements, and numpy refuses the shape)
        if (count > limits.max_tensor_elements or max(dims, default=0) > limits.max_tensor_elements
                or (size - pos) != count * ITEMSIZE[code]):
            raise ProtocolError(f"{KINDS[kind].TYPE}.hidden: shape {list(dims)} x "
                                f"{DTYPE_NAMES[code]} needs {count * ITEMSIZE[code]} bytes, the "
                                f"frame has {size - pos} (limit {limits.max_tensor_elements} "
                                f"elements)")
        hidden = np.frombuffer(body, dtype, count, pos).reshape(dims).copy()
    elif size != pos:
        raise ProtocolError(f"step frame: {size - pos} bytes after the header and no tensor")
    if error is not None and len(error) > m.MAX_ERROR:
        raise ProtocolError(f"{KINDS[kind].TYPE}.error: {len(error)} long, the limit is "
                            f"{m.MAX_ERROR}")
    t = texts[3 + rank:]
    return KINDS[kind](plan_id=plan, session=session, step=step, start=start, hidden=hidden,
                       error=error, trace=list(zip(t[::2], t[1::2], strict=True)))


Lone = tuple[str, int, bytes, memoryview, memoryview]


def lone_step(body: memoryview, plan: bytes, hidden: int, onward: bool) -> Lone | None:
    """The decode lane's reading of a step (node/dataplane.py): a forward of plan `plan`
    (its id's UTF-8) carrying one float32 token (1, 1, `hidden`), with no error, that may pass
    one more stage, read in place. -> (session, start, the next frame's bytes before its new
    trace entry, the tensor's bytes, the bytes between that entry and the output), with the
    next frame a forward (`onward`) or the result; None: not such a step (it goes the general
    way, `parse`). Checked in the same terms as `parse`."""
    (_, kind, flags, n_trace, step, start, n_plan, n_session, n_error, code, rank) = \
        HEAD.unpack_from(body)
    ids_end = HEAD.size + n_plan + n_session
    ints_end = ids_end + 4 * (3 + 2 * n_trace)
    pos = ints_end + -ints_end % 4
    if (kind != 1 or flags != HIDDEN or code != F32 or rank != 3 or n_error
            or n_trace >= m.MAX_STAGES - 1 or step > m.RID or start > m.MAX_START
            or len(body) != pos + 4 * hidden or body[HEAD.size:ids_end - n_session] != plan
            or body[ids_end:ids_end + 12] != DIMS.pack(1, 1, hidden)):
        return None
    try:
        session = bytes(body[ids_end - n_session:ids_end]).decode()
    except UnicodeDecodeError:
        return None
    # all of the next frame that does not depend on the output (an entry longer trace, the
    # same padding: 8 bytes more)
    prefix = b"".join((LEN.pack(pos + 8 + 4 * hidden),
                       HEAD.pack(MAGIC, 1 if onward else 2, flags, n_trace + 1, step, start,
                                 n_plan, n_session, 0, code, 3),
                       body[HEAD.size:ints_end]))
    return session, start, prefix, body[pos:], body[ints_end:pos]


def lane_frame(prefix: bytes, tail: memoryview, compute_ms: float, since_s: float,
               out: bytes | memoryview) -> bytes:
    """The whole next frame of a `lone_step`: its trace entry (this stage's compute and its
    time since the step came in, `since_s` a perf_counter() reading), then the output."""
    entry = PAIR.pack(min(max(round(compute_ms * 1e3), 0), U32),  # (clamped as encode_fields does)
                      min(max(round((time.perf_counter() - since_s) * 1e6), 0), U32))
    return b"".join((prefix, entry, tail, out))


def _header_error(head: tuple[int, ...], size: int, limits: WireLimits) -> ProtocolError:
    """What is wrong with a step frame's header."""
    _, kind, flags, n_trace, step, start, n_plan, n_session, n_error, code, rank = head
    name = KINDS[kind].TYPE if kind in KINDS else "step frame"
    need = HEAD.size + n_plan + n_session + n_error + 4 * (rank + 2 * n_trace)
    need += -need % 4  # (the tensor starts on a multiple of 4)
    for bad, why in (
            (kind not in KINDS, f"unknown kind {kind}"),
            (flags > 3, f"unknown flags {flags:#x}"),
            (n_trace >= m.MAX_STAGES, f"trace: {n_trace} long, the limit is {m.MAX_STAGES - 1}"),
            (step > m.RID, f"step: {step} is outside 0..{m.RID}"),
            (start > m.MAX_START, f"start: {start} is outside 0..{m.MAX_START}"),
            (n_plan > m.ID or n_session > m.ID, f"plan_id or session longer than {m.ID}"),
            (n_error > MAX_ERROR_BYTES, f"error: {n_error} bytes, over {MAX_ERROR_BYTES}"),
            ((n_error > 0) != (flags & ERROR > 0), "error bytes and the error flag disagree"),
            (rank > limits.max_tensor_dims, f"hidden: rank {rank} over the limit "
                                            f"{limits.max_tensor_dims}"),
            (code >= len(DTYPE_NAMES), f"hidden: unknown dtype code {code}"),
            (not flags & HIDDEN and (rank or code), "hidden: a shape without the hidden flag")):
        if bad:
            return ProtocolError(f"{name}: {why}")
    return ProtocolError(f"{name}: {size} bytes, its header describes at least {need}")
