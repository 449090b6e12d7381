"""Every message on the wire, one frozen dataclass each (see schema.py for how they are checked).

Connections start with the handshake (Hello, Auth, Welcome). A node then answers control
requests (each carries an `id` its reply repeats) until the client turns the connection into a
data connection (OpenData): from then on it carries Forward steps into the node, or Result
steps back to the client. A gateway answers Generate and GatewayStatsRequest.
"""

from __future__ import annotations

from typing import Any, Literal

from edgelite.config import WireLimits
from edgelite.errors import ProtocolError
from edgelite.ids import NodeAddr
from edgelite.net.schema import Json, Message, Tensor, bounds, message, parse, record

RID = 2**53  # request ids: any integer a JSON client could also send
SHA = 64  # a sha256 in hex
ID = 64  # plan and session ids (128-bit hex is 32)
MAX_ROLE_TEXT = 1 << 20  # one chat message
MAX_STAGES = 64  # stages a step may pass (its trace's length)
MAX_START = 1 << 30  # a step's position in its session
MAX_ERROR = 2048  # characters of a step's error


def reply_id(frame: dict[str, Any]) -> int | None:
    """The id a refusal of this (perhaps malformed) request echoes: its own when the schema
    accepts it, else none (an echoed id out of range would make the reply itself invalid)."""
    rid = frame.get("id")
    return rid if type(rid) is int and -RID <= rid <= RID else None


def expect(frame: dict[str, Any], limits: WireLimits, *kinds: type[Message]) -> Any:
    """parse() for a reply that must be one of `kinds`; an Error reply raises ProtocolError
    with the peer's message (unless Error is among `kinds`)."""
    msg = parse(frame, limits)
    if not isinstance(msg, kinds):
        if isinstance(msg, Error):
            raise ProtocolError(msg.message)
        raise ProtocolError(f"expected {' or '.join(k.TYPE for k in kinds)}, got {msg.TYPE}")
    return msg


@message("error")
class Error(Message):
    """A refusal; `id` names the request it answers (None: the connection as a whole)."""

    message: str = bounds(max_len=2048)
    id: int | None = bounds(-RID, RID, default=None)


# ---- handshake ---------------------------------------------------------------------------
@message("hello")
class Hello(Message):
    version: int
    nonce: bytes = bounds(max_len=64)
    node: str = bounds(max_len=128)


@message("auth")
class Auth(Message):
    version: int
    nonce: bytes = bounds(max_len=64)
    mac: bytes = bounds(max_len=64)
    fingerprint: str | None = bounds(max_len=SHA, default=None)
    user: str | None = bounds(max_len=128, default=None)
    # a random key the client keeps for its life: its connections with the same key are one
    # client, which owns the plans it loads (None: this connection alone)
    client: str | None = bounds(max_len=ID, default=None)
    # a secret the client keeps across its restarts: its KV stored on the node is found, read
    # and restored only under it (None: under `client`, else this connection's alone)
    kv: str | None = bounds(max_len=ID, default=None)


@message("welcome")
class Welcome(Message):
    mac: bytes = bounds(max_len=64)
    node: str = bounds(max_len=128)
    fingerprints: list[str] = bounds(max_len=256, default=[])
    port: int | None = bounds(0, 65535, default=None)
    udp_port: int | None = bounds(0, 65535, default=None)


# ---- control requests to a node, and their replies ---------------------------------------
@message("ping")
class Ping(Message):
    id: int = bounds(-RID, RID)
    t: float | None = None  # the sender's clock, echoed


@message("pong")
class Pong(Message):
    id: int = bounds(-RID, RID)
    rt: float  # the node's monotonic clock on receipt (one-way delay variation)
    t: float | None = None


@message("stats")
class StatsRequest(Message):
    id: int = bounds(-RID, RID)


@message("stats_ok")
class StatsReply(Message):
    id: int = bounds(-RID, RID)
    stats: Json


@message("files")
class FilesQuery(Message):
    id: int = bounds(-RID, RID)
    sha256: list[str] = bounds(max_len=4096)


@message("files_ok")
class FilesState(Message):
    id: int = bounds(-RID, RID)
    have: list[str] = bounds(max_len=4096)
    partial: dict[str, int] = bounds(max_len=4096)


@message("upload")
class Upload(Message):
    id: int = bounds(-RID, RID)
    sha256: str = bounds(max_len=SHA)
    offset: int = bounds(0, 2**50)
    total: int = bounds(0, 2**50)
    data: bytes


@message("upload_ok")
class UploadAck(Message):
    id: int = bounds(-RID, RID)
    held: int
    complete: bool


@message("model_put")
class ModelPut(Message):
    """Keep the uploaded files (already sent as blobs) as a model folder on the node:
    DATA_DIR/models/NAME/FILE for every FILE -> sha256 (`edgelite push`)."""

    id: int = bounds(-RID, RID)
    name: str = bounds(max_len=64)
    files: dict[str, str] = bounds(max_len=4096)


@message("model_stored")
class ModelStored(Message):
    id: int = bounds(-RID, RID)
    path: str = bounds(max_len=4096)
    files: int


@message("models")
class ModelsQuery(Message):
    """What the node keeps: its model folders and its deployed files (`edgelite models`)."""

    id: int = bounds(-RID, RID)


@record
class ShelvedModel:
    """A model folder on a node (node/shelf.py ExportFolder, and whether the asker pushed it)."""

    name: str = bounds(max_len=64)
    title: str = bounds(max_len=256)
    weights: str = bounds(max_len=16)
    layers: int = bounds(0, 1 << 16)
    bytes: int = bounds(0, 2**62)
    yours: bool


@record
class BlobSummary:
    """A node's deployed files (node/blobs.py BlobFigures)."""

    files: int = bounds(0, 2**31)
    bytes: int = bounds(0, 2**62)
    unused_files: int = bounds(0, 2**31)
    unused_bytes: int = bounds(0, 2**62)
    recent_files: int = bounds(0, 2**31, default=0)  # unused, but used within the grace time
    recent_bytes: int = bounds(0, 2**62, default=0)


@message("models_ok")
class ModelsState(Message):
    id: int = bounds(-RID, RID)
    models: list[ShelvedModel] = bounds(max_len=4096)
    blobs: BlobSummary


@message("model_rm")
class ModelRemove(Message):
    """Delete a model folder this client pushed."""

    id: int = bounds(-RID, RID)
    name: str = bounds(max_len=64)


@message("model_rm_ok")
class ModelRemoved(Message):
    id: int = bounds(-RID, RID)
    bytes: int


@message("blobs_gc")
class BlobsCollect(Message):
    """Delete now the deployed files nothing uses (no loaded plan, no model folder)."""

    id: int = bounds(-RID, RID)


@message("blobs_gc_ok")
class BlobsCollected(Message):
    id: int = bounds(-RID, RID)
    files: int
    bytes: int


@message("load")
class Load(Message):
    """Load a plan's stage; the plan then belongs to this connection's client."""

    id: int = bounds(-RID, RID)
    plan_id: str = bounds(max_len=ID)
    first: int = bounds(0, 1 << 16)
    last: int = bounds(0, 1 << 16)
    next: NodeAddr | None  # the stage after this one (None: the last stage)
    manifest: Json
    next_capability: str | None = bounds(max_len=ID, default=None)  # the next stage's capability
    # the most tokens a step of this plan carries (its memory was planned for prompt chunks
    # of this); 0: the model's default largest
    max_chunk: int = bounds(0, 1 << 16, default=0)


@message("load_ok")
class Loaded(Message):
    """`capability`: what opens a data connection of this plan (only its owner has it)."""

    id: int = bounds(-RID, RID)
    first: int
    last: int
    capability: str = bounds(max_len=ID)


@message("end")
class EndSession(Message):
    id: int = bounds(-RID, RID)
    plan_id: str = bounds(max_len=ID)
    session: str = bounds(max_len=ID)


@message("end_ok")
class Ended(Message):
    id: int = bounds(-RID, RID)
    freed: int


MAX_KV_TOKENS = 1 << 20  # token ids in one KV store request (4 bytes each)


@message("kv_save")
class KvSave(Message):
    """Store the session's KV for these token ids (int32 little-endian): the ids it consumed.
    The answer comes once the entry is on disk, or, `behind`, once the KV is copied (it is
    written behind; a later restore or export on the node waits for the write)."""

    id: int = bounds(-RID, RID)
    plan_id: str = bounds(max_len=ID)
    session: str = bounds(max_len=ID)
    tokens: bytes = bounds(max_len=4 * MAX_KV_TOKENS)
    behind: bool = False


@message("kv_saved")
class KvSaved(Message):
    id: int = bounds(-RID, RID)
    bytes: int  # written (0: not kept, or the node keeps no KV store)


@record
class KvSource:
    """Where a stage's KV may be stored when its layers moved (another plan held them): the
    store of the node at `addr` (None: the asked node's own), in its entries of layers
    first..last."""

    first: int = bounds(0, 1 << 16)
    last: int = bounds(0, 1 << 16)
    addr: NodeAddr | None = None


@message("kv_restore")
class KvRestore(Message):
    """Start the session from the node's KV store: the longest stored prefix of these token
    ids (int32 little-endian), or, with `exact`, all of them or nothing. With `sources`, the
    stage's layers are taken from the entries of the plan that held them before (fetched
    from the nodes named; the prefix all of them hold), not from entries of its own range."""

    id: int = bounds(-RID, RID)
    plan_id: str = bounds(max_len=ID)
    session: str = bounds(max_len=ID)
    tokens: bytes = bounds(max_len=4 * MAX_KV_TOKENS)
    exact: bool = False
    sources: list[KvSource] = bounds(max_len=MAX_STAGES, default=[])


@message("kv_restored")
class KvRestored(Message):
    id: int = bounds(-RID, RID)
    # positions the session starts from (0: nothing stored). The entry may still be being
    # read: the session's steps wait for it on the node, and fail if it does not pass
    length: int


@message("kv_export")
class KvExport(Message):
    """Another node asks for layers first..last (indices within `layout`'s range) of this
    node's stored KV for the longest stored prefix of `tokens`: read and checked now, then
    fetched with kv_export_read."""

    id: int = bounds(-RID, RID)
    layout: Json  # the entry's Layout (engine/kvstore.py), as its to_json()
    tokens: bytes = bounds(max_len=4 * MAX_KV_TOKENS)
    first: int = bounds(0, 1 << 16)
    last: int = bounds(0, 1 << 16)


@message("kv_export_ok")
class KvExportReady(Message):
    """`length` positions are ready as `size` bytes (the layout's dtype, (layers, 2, kv_heads,
    length, head_dim)) under `handle` (0 positions: nothing stored, no handle)."""

    id: int = bounds(-RID, RID)
    length: int = bounds(0, MAX_KV_TOKENS)
    size: int = bounds(0, 2**50)
    handle: str = bounds(max_len=ID, default="")


@message("kv_export_read")
class KvExportRead(Message):
    id: int = bounds(-RID, RID)
    handle: str = bounds(max_len=ID)
    offset: int = bounds(0, 2**50)


@message("kv_export_data")
class KvExportData(Message):
    """The export's bytes from the offset asked (at most the node's chunk size; the export
    is dropped once its last byte is sent)."""

    id: int = bounds(-RID, RID)
    data: bytes


@message("bulk")
class Bulk(Message):
    """A link probe's bulk transfer: `data` one way, `reply_bytes` back."""

    id: int = bounds(-RID, RID)
    data: bytes
    reply_bytes: int = bounds(0, 2**40)


@message("bulk_ok")
class BulkAck(Message):
    id: int = bounds(-RID, RID)
    received: int
    data: bytes


@message("profile")
class ProfileRequest(Message):
    """Time this device: on the model's layer 0 when `manifest` is given (and its files are
    here), else on a GEMV of `hidden_size`."""

    id: int = bounds(-RID, RID)
    hidden_size: int = bounds(0, 1 << 16, default=0)
    manifest: Json | None = None


@message("profile_ok")
class ProfileReply(Message):
    id: int = bounds(-RID, RID)
    profile: Json


@message("probe_link")
class ProbeLink(Message):
    """Ask a node to measure its link to a peer node."""

    id: int = bounds(-RID, RID)
    peer: NodeAddr
    config: Json


@message("probe_link_ok")
class LinkReport(Message):
    id: int = bounds(-RID, RID)
    link: Json


@message("data")
class OpenData(Message):
    """Turn this connection into a data connection of a plan: `in` carries steps into the node,
    `sink` takes the last stage's results back to the plan's client."""

    id: int = bounds(-RID, RID)
    plan_id: str = bounds(max_len=ID)
    role: Literal["in", "sink"]
    capability: str = bounds(max_len=ID)


@message("data_ok")
class DataReady(Message):
    id: int = bounds(-RID, RID)


# ---- data connections --------------------------------------------------------------------
@message("forward")
class Forward(Message):
    """One step of a session into a stage: `hidden` (batch, seq, hidden) at position `start`,
    or the `error` an earlier stage met. `trace` holds [compute_us, held_us] per stage passed."""

    plan_id: str = bounds(max_len=ID)
    session: str = bounds(max_len=ID)
    step: int = bounds(0, RID)
    start: int = bounds(0, MAX_START)
    hidden: Tensor | None = None
    error: str | None = bounds(max_len=MAX_ERROR, default=None)
    trace: list[tuple[int, int]] = bounds(max_len=MAX_STAGES, default=[])


@message("result")
class Result(Message):
    """A step's outcome from the last stage (or a refusal), back to the client."""

    plan_id: str = bounds(max_len=ID)
    session: str = bounds(max_len=ID)
    step: int = bounds(0, RID)
    start: int = bounds(0, MAX_START)
    hidden: Tensor | None = None
    error: str | None = bounds(max_len=MAX_ERROR, default=None)
    trace: list[tuple[int, int]] = bounds(max_len=MAX_STAGES, default=[])


# ---- gateway -----------------------------------------------------------------------------
@record
class ChatMessage:
    role: str = bounds(max_len=64)  # (which roles a gateway takes: serve/ask.py)
    content: str = bounds(max_len=MAX_ROLE_TEXT)
    # an assistant's tool calls: JSON text of [{"name", "arguments"}] (serve/ask.py)
    tool_calls: str | None = bounds(max_len=1 << 16, default=None)


@message("generate")
class GenerateRequest(Message):
    """A reply asked of a gateway. Types and sizes are the wire's; the rules on the values
    (serve/ask.py) are the gateway's, the same as over HTTP."""

    id: int = bounds(-RID, RID)
    messages: list[ChatMessage] | None = bounds(max_len=1024, default=None)
    prompt: str | None = bounds(max_len=MAX_ROLE_TEXT, default=None)
    # None: the gateway's defaults (`edgelite serve --max-tokens ...`)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = bounds(-(2**63), 2**64 - 1, default=None)
    stop: list[str] | None = bounds(max_len=64, default=None)  # the reply ends before any of these
    speculate: str | None = bounds(max_len=32, default=None)  # off | lookup
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None  # with each token its log probability and this many alternatives
    response_format: str | None = bounds(max_len=32, default=None)  # text | json_object | json_schema
    json_schema: str | None = bounds(max_len=1 << 16, default=None)  # with json_schema: JSON text
    tools: str | None = bounds(max_len=1 << 16, default=None)  # OpenAI's tools list as JSON text
    tool_choice: str | None = bounds(max_len=64, default=None)  # auto | none | required | a name


@message("generate_cancel")
class GenerateCancel(Message):
    """Stop one of this client's requests (Ctrl-C in `chat --gateway`)."""

    id: int = bounds(-RID, RID)


@message("token")
class TokenPiece(Message):
    id: int = bounds(-RID, RID)
    text: str = bounds(max_len=4096)
    token_id: int = bounds(0, 1 << 30)
    logprob: float | None = None  # (GenerateRequest.logprobs)
    top_ids: list[int] = bounds(max_len=64, default=[])  # the likeliest alternatives
    top_logprobs: list[float] = bounds(max_len=64, default=[])  # and their log probabilities


@message("done")
class Done(Message):
    id: int = bounds(-RID, RID)
    token_ids: list[int] = bounds(max_len=1 << 20)
    finish: str = bounds(max_len=32)
    tier: int
    preemptions: int
    ttft_ms: float | None = None
    decode_tok_s: float = 0.0
    text: str = bounds(max_len=4096, default="")  # text held back until the end (after the last piece)
    prompt_tokens: int = 0
    tool_call: str = bounds(max_len=1 << 16, default="")  # finish tool_calls: {"name", "arguments"}


@message("embedded")
class Embedded(Message):
    """An embedding asked of a gateway (serve/http.py's /v1/embeddings): reply/embed.py's
    vector of the text."""

    id: int = bounds(-RID, RID)
    vector: list[float] = bounds(max_len=1 << 16)
    prompt_tokens: int = 0
    tier: int = 0


@message("gateway_stats")
class GatewayStatsRequest(Message):
    id: int = bounds(-RID, RID)


@message("gateway_stats_ok")
class GatewayStats(Message):
    id: int = bounds(-RID, RID)
    stats: Json
