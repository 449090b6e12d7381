"""Every timeout, limit and weight as a named field of a frozen dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field

# the most positions a session may take back (`KVPool.rollback`: the drafts a speculative
# step's verification rejected; `Backend.rollback`); windowed layers keep this many more than
# their window. A protocol fact the KV, the nodes and the reply side share, not a setting.
MAX_ROLLBACK = 16


@dataclass(frozen=True)
class KVStoreConfig:
    """Sessions' KV kept on disk by token prefix (engine/kvstore.py): a conversation resumes
    after a restart, a shared prefix is computed once, a preempted request is swapped out."""

    # where (None: a node keeps it in DATA_DIR/kv, a client in $EDGELITE_HOME/kv, where
    # EDGELITE_HOME defaults to ~/.edgelite)
    dir: str | None = None
    budget_bytes: int = 512 * 1024 * 1024  # disk for entries; least recently used go (0: off)
    block_tokens: int = 16  # prefixes are found in whole blocks of this many tokens
    # saves are written behind (a finished request does not wait for the disk); at most this
    # many bytes of KV copies wait for the writer (a save beyond it waits for earlier ones)
    max_pending_write_bytes: int = 64 * 1024 * 1024
    writer_nice: int = 10  # the writer thread runs this far below normal priority

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0


@dataclass(frozen=True)
class RuntimeConfig:
    threads: int = 2  # onnxruntime intra-op threads (one pool shared by the process's sessions)
    # Idle pool threads spin briefly before sleeping: with threads > 1 on a device of its own,
    # 85 -> 118 tok/s (int4 SmolLM2, 2 threads); several multi-threaded processes sharing cores
    # would starve each other (measured: 40 -> 14 tok/s), so turn it off there (--no-spin).
    allow_spinning: bool = True
    verify_hashes: bool = True  # sha256 every file on load
    provider: str = "cpu"  # cpu | xnnpack | nnapi (the latter two where onnxruntime has them)
    # onnxruntime's arena keeps the largest shapes' buffers for good; off, memory follows use
    cpu_arena: bool = False
    # a prompt runs in chunks of these sizes (the last one padded up): bounded shapes, and
    # no (prompt x prompt) attention at once
    prefill_chunks: tuple[int, ...] = (4, 16, 64, 256)
    # what a chunk costs beyond its padded tokens (a call, a hop), in tokens: prompts are cut
    # into the chunks that run the fewest padded tokens + this per chunk
    chunk_overhead_tokens: int = 4
    # through a pipeline of stages a prompt goes in smaller chunks (the stages work on
    # different chunks at once: engine/runtime.py chunks_of), but none smaller than this
    # (a chunk of 4 costs 1.96 ms a token per 10 int4 layers at context 1,000, one of 16 1.42)
    pipeline_min_chunk: int = 16
    # KV is accounted per session in these capacities (positions); the largest caps the context
    # up to the model's own context (a range holds min(max_positions, the largest bucket));
    # the memory is reserved, not committed, until positions are written
    # (a session's KV is accounted at the smallest that covers it: steps of 1.5x and 2x keep
    # the accounting within 1.5x of what it holds; a 5,200-token prompt counts 6,144, not 8,192)
    kv_buckets: tuple[int, ...] = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
                                   8192, 12288, 16384, 24576, 32768)
    # consecutive layers join one onnxruntime session up to this many MiB of weights (fewer
    # calls); loading a session widens its compact scales in memory at once, so this bounds
    # that transient (engine/layers.py)
    session_weights_mb: int = 48
    # a graph's constant part (compact scales widened, narrow codes unpacked) is computed in
    # numpy as a session loads and handed over as mapped file pages the kernel then drops
    # (engine/fold.py); off, onnxruntime folds it into heap tensors it keeps
    fold_at_load: bool = True
    # while a session packs folded tensors, their mapped pages are dropped this often (0: only
    # once it is made): a 1 B head's load peaked at 288 MiB holding its whole widened table
    fold_trim_s: float = 0.005
    kv_slab_slots: int = 4  # sessions sharing one preallocated KV slab (a batch stays in one)
    # a fast (int8-activation) head's best candidates are recomputed exactly (0: off)
    exact_head_candidates: int = 32
    # every row of a step is computed as it would be in any other step (engine/passes/invariant.py):
    # the reply does not depend on chunking, the split, the KV store or load; decode steps of
    # several sessions then run as one batch only where edgelite's operators compute every
    # row as alone (LayerRange.batchable), else one by one
    invariant: bool = True
    # what the KV cache holds: "float32", "float16" (half the memory a position costs; needs
    # `invariant`), "int8" (about a quarter: each head's row as codes and one exponent; needs
    # the attention kernel), or "auto": float16 for fast-mode exports, float32 for fp32 and
    # exact ones (Manifest.kv_dtype)
    kv_dtype: str = "auto"
    # where `invariant`, attention runs in edgelite's own operator (engine/kernels: C built for
    # the device, in the background from a node's start, else at first use), which reads the
    # valid KV once a step; off, or where no C compiler works, onnxruntime's operators
    # (engine/passes/attention.py, engine/passes/invariant.py)
    attention_kernel: bool = True
    # fast-mode 4-bit, Q4_K, Q6_K and 8-bit products in edgelite's own operators (the same
    # library: engine/passes/linear.py), which read the weights as stored (4 bits and a float scale a
    # block; Q6_K's 6.56 bits) where onnxruntime's MatMulNBits packs them again; only the kinds
    # the device has a vector path for (kernels.matmul_kinds), else onnxruntime's
    matmul_kernel: bool = True
    kernel_build_s: float = 180.0  # the longest the library's compile may take before it is given up
    kernel_check_s: float = 60.0  # the longest its check (in a child process) may take
    # a step is cancelled past the larger of these: step_deadline_s, and step_deadline_factor
    # times what the range's steps of as many rows have taken (engine/deadline.py)
    step_deadline_s: float = 30.0
    step_deadline_factor: float = 20.0
    # onnxruntime's per-operator timings written to files starting with this (empty: off; for
    # benchmarks: scripts/bench_breakdown.py)
    profile_prefix: str = ""
    kv_store: KVStoreConfig = field(default_factory=KVStoreConfig)

    @property
    def plan_chunks(self) -> tuple[int, ...]:
        """The prompt chunk sizes a plan may choose among where memory is short (the planner
        takes the largest that fits): these, none below the pipeline's smallest."""
        return (tuple(c for c in self.prefill_chunks if c >= self.pipeline_min_chunk)
                or (max(self.prefill_chunks),))


@dataclass(frozen=True)
class GenerationConfig:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # sampling seed (None: a fresh one each reply)
    stop: tuple[str, ...] = ()  # the reply ends before the first of these strings
    # speculative decoding (reply/speculate.py): off, lookup (drafts from the prompt and the
    # reply), draft (a draft model's, loaded with the model: `--speculate DIR`)
    speculate: str = "off"
    draft_tokens: int = 0  # drafts a round (0: chosen each round from the measured figures)
    top_k: int = 0  # sample from the k most likely tokens only (0: all)
    min_p: float = 0.0  # ... and only those at least this fraction of the likeliest's probability
    # OpenAI's: minus presence_penalty for a token the reply has used, minus frequency_penalty
    # per use; and HF's repetition_penalty for every token of the prompt and the reply
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int = -1  # each token's log probability and this many alternatives (-1: none)
    # text, or json_object: every token is one that keeps the reply a JSON object's prefix,
    # and the reply ends when the object does (reply/jsonprefix.py; no speculation then);
    # json_schema: an object `json_schema` (JSON text, reply/jsonschema.py's subset) accepts
    response_format: str = "text"
    json_schema: str = ""
    # OpenAI's tools (JSON text of its `tools` list; "": none) and tool_choice (auto, none,
    # required or a tool's name): a reply may be a call (reply/tools.py; no speculation then)
    tools: str = ""
    tool_choice: str = "auto"
    # a JSON or tool-call constraint's choice of one token takes at most this long (a full
    # scan of the vocabulary against a costly schema); past it the reply ends with an error
    constraint_token_s: float = 2.0


@dataclass(frozen=True)
class WireLimits:
    max_frame_bytes: int = 64 * 1024 * 1024  # largest frame accepted after the handshake
    max_handshake_frame_bytes: int = 4096  # largest frame read from a peer not yet authenticated
    frame_body_timeout_s: float = 30.0  # a frame's body must arrive this soon after its length
    max_tensor_elements: int = 64 * 1024 * 1024
    max_tensor_dims: int = 6


@dataclass(frozen=True)
class NodeConfig:
    host: str = "127.0.0.1"
    port: int = 7070
    discovery_port: int = 7079  # UDP: answer `--nodes auto` questions here (0: not at all)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # threads, provider, KV shapes
    kv_budget_bytes: int = 512 * 1024 * 1024  # KV of all sessions on this node
    memory_budget_bytes: int | None = None  # what plans may use here (None: the free memory)
    # a --memory-mb below what the node process holds at start plus this is refused then (no
    # layer would ever fit: every load refused)
    memory_min_room_bytes: int = 16 * 2**20
    bulk_reply_max_bytes: int = 4 * 1024 * 1024  # largest reverse transfer a link probe may ask
    bulk_concurrency: int = 2  # bulk transfers served at once (each holds its reply in memory)
    probe_concurrency: int = 1  # link probes this node runs at once, for any client (more wait)
    max_probe_packets: int = 500  # UDP datagrams one link probe may send
    max_probe_bytes: int = 4 * 1024 * 1024  # bulk bytes one link probe may send each way
    max_probe_timeout_s: float = 10.0  # the longest per-request timeout a probe may ask for
    max_profile_hidden: int = 4096  # the largest GEMV side a profile request may ask for
    max_profile_bytes: int = 16 * 1024 * 1024  # the most weight bytes a profile GEMV allocates
    # a profile asked while the kernel library still builds (from the node's start) waits this
    # long for it, then answers with onnxruntime's figures and says the kernel is building
    kernel_wait_s: float = 10.0
    # open connections (control and data, authenticated or not: net/admission.py), all peers
    # and from one address; those not yet authenticated have their own budget within it (all
    # of them, and from one address), each at most handshake_timeout_s: strangers cannot keep
    # clients out
    max_connections: int = 192
    max_connections_per_address: int = 128
    max_unauthenticated: int = 64
    max_unauthenticated_per_address: int = 16
    # requests of one control connection run at once (each answered when it is done, so a
    # slow one, a KV write or a model load, does not hold back that client's heartbeats);
    # more wait their turn, up to max_queued_requests; pings are answered as they are read
    max_requests_per_connection: int = 8
    max_queued_requests: int = 64  # per connection, running or waiting: then it is not read
    # and the frames they came in, in bytes (a frame is read when less than this is held)
    max_queued_request_bytes: int = 16 * 1024 * 1024
    # frames of requests being read or answered, over all connections: a frame beyond it waits
    # unread until others are done (one frame always fits: up to WireLimits.max_frame_bytes)
    max_held_frame_bytes: int = 96 * 1024 * 1024
    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 600.0  # a control connection silent this long is closed
    forward_connect_timeout_s: float = 2.0
    forward_timeout_s: float = 30.0  # a data connection's peer that takes nothing this long is dropped
    session_ttl_s: float = 1800.0  # a session unused this long frees its KV
    owner_grace_s: float = 2.0  # a client's plans and sessions go this long after it disconnects
    max_sessions_per_client: int = 64  # sessions holding KV, over a client's plans
    # the clients of one address may hold at most this share of the KV budget together
    # (client keys are chosen freely; the rest stays for others)
    max_address_kv_share: float = 0.75
    max_plans_per_client: int = 16
    max_file_bytes: int = 4 * 1024**3  # the largest model file an upload may declare
    disk_quota_bytes: int = 16 * 1024**3  # deployed files (and partial uploads) in all
    part_ttl_s: float = 3600.0  # a partial upload untouched this long is deleted
    # deployed files no loaded plan and no pushed model folder uses, and unused this long, are
    # deleted (0: kept until the disk quota needs their room)
    blob_idle_ttl_s: float = 7 * 86400.0
    # a deployed file used this recently is never deleted to make room (a deploy under way)
    blob_grace_s: float = 3600.0
    # decode steps of several sessions that arrive together run as one batch (weights read once)
    # (only where the runtime is not `invariant`: batched rows come out otherwise than alone)
    batch_max_steps: int = 8  # 1: never batch
    # a batch of at least this many decode steps runs as two halves, the first passed on
    # before the second runs: two waves of sessions keep two stages busy at once, where one
    # batch would leave each stage idle while the others work (0: never split)
    wave_split_min: int = 4
    # steps of a session whose KV is being read from the KV store wait for it (on the data plane)
    max_waiting_steps: int = 64  # per session; more are refused
    max_unrestored_kept: int = 256  # failed restores remembered to tell the session's next step
    # KV of layers that moved to another node (kv_export, KvRestore.sources)
    kv_export_chunk_bytes: int = 4 * 1024 * 1024  # bytes per kv_export_read reply
    max_kv_exports: int = 8  # exports held at once for other nodes (each in memory until read)
    max_kv_export_bytes: int = 256 * 1024 * 1024  # their bytes in all
    kv_export_ttl_s: float = 60.0  # an export not read to its end this long is dropped
    kv_fetch_timeout_s: float = 10.0  # each request to a node this node fetches KV from
    queued_call_timeout_s: float = 120.0  # work queued behind a step (a long prefill) on its thread
    supervise_s: float = 1.0  # how often the data plane's thread is checked (and restarted)
    shutdown_timeout_s: float = 5.0  # on the way out, how long connections and threads may take


@dataclass(frozen=True)
class DiscoveryConfig:
    """Finding nodes on the LAN (`--nodes auto`): a UDP broadcast question, answered by nodes."""

    port: int = 7079  # UDP port nodes listen on for questions (every node of a device shares it)
    wait_s: float = 1.5  # how long the client collects answers
    resend_s: float = 0.25  # the question is sent again this often while waiting
    broadcast: tuple[str, ...] = ("255.255.255.255",)  # where the question goes


@dataclass(frozen=True)
class ClientConfig:
    connect_timeout_s: float = 2.0
    local_host: str | None = None  # the address connections to nodes go from (None: any)
    step_timeout_s: float = 2.0  # no reply for a step within this -> the stage is declared dead
    # ... or within this many times the plan's predicted ms a token, where that is longer (a
    # large model on slow phones, a node under emulation: client/stepplane.py decode_timeout)
    step_timeout_factor: float = 20.0
    prefill_timeout_s: float = 60.0  # a long prompt on a slow phone may take this long
    deploy_timeout_s: float = 120.0
    deploy_chunk_bytes: int = 4 * 1024 * 1024  # one upload frame
    request_timeout_s: float = 10.0  # control requests (load plan, stats)
    end_timeout_s: float = 2.0  # freeing a session's KV; best effort
    kv_store_timeout_s: float = 30.0  # a node storing or restoring a session's KV
    trace_window: int = 256  # recent steps whose per-stage timings are kept (stats, benchmarks)
    shutdown_timeout_s: float = 5.0  # closing: how long the step thread may take to finish
    # every stage node is pinged this often on its control connection; one with no answer
    # for heartbeat_timeout_s is lost (its steps fail at once, even mid-prompt)
    heartbeat_interval_s: float = 0.2
    heartbeat_timeout_s: float = 0.8
    failover: bool = True  # a lost node: replan on the others and go on (else: an error)
    max_failovers: int = 3  # recoveries one step may go through before its error is raised
    # nodes a recovery left out are asked this often whether they answer again; those that do
    # are planned in again (the gateway asks between rounds)
    rejoin_interval_s: float = 5.0
    # a failover keeps the layers where they are (a spare takes the lost node's range) where
    # that plan is within this fraction of the best one (an 8 B recovery moved GBs otherwise)
    failover_keep_slack: float = 0.15
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)


@dataclass(frozen=True)
class HttpConfig:
    """`edgelite serve --http`: the OpenAI-compatible API."""

    host: str = "127.0.0.1"
    port: int = 8080
    # a request body larger than this is refused (413), before it is parsed: it holds the
    # largest prompt the gateway takes (max_prompt_chars, 131,072) as plain JSON text
    max_body_bytes: int = 256 * 1024
    # a refused body up to this size is read (and dropped) before the 413 is sent, within the
    # time below: a client that writes its whole body before reading (urllib, requests) then
    # gets the answer, not a connection reset by a close with its bytes unread
    refused_body_drain_bytes: int = 512 * 1024  # (one declared larger is not read at all)
    refused_body_drain_s: float = 5.0
    sse_keepalive_s: float = 5.0  # a streamed reply with nothing new this long gets a comment
    keep_alive_s: int = 5  # an idle HTTP/1.1 connection is closed after this
    max_connections: int = 256  # open HTTP connections; more are closed as they come
    max_connections_per_address: int = 32  # of them from one address
    header_timeout_s: float = 10.0  # a request's headers must be in this soon (else: closed)
    body_timeout_s: float = 30.0  # and its body this soon after them (else: 408)
    cluster_stats_timeout_s: float = 2.0  # the page's figures wait this long for the nodes'
    max_embedding_inputs: int = 64  # texts one /v1/embeddings request may embed


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 7080
    handshake_timeout_s: float = 5.0
    # the native door's connections (net/admission.py): open, from one address, and of them
    # not yet authenticated, all and from one address
    max_connections: int = 256
    max_connections_per_address: int = 64
    max_unauthenticated: int = 64
    max_unauthenticated_per_address: int = 16
    idle_timeout_s: float = 600.0  # a client connection silent this long is closed
    max_prompt_chars: int = 131_072  # (about 30,000 tokens of English: the cheap guard before tokenizing)
    max_tokens_limit: int = 2048  # the most a request may ask for
    max_temperature: float = 2.0  # (OpenAI's bound)
    max_stops: int = 4  # stop strings per request
    max_stop_chars: int = 256  # characters per stop string
    max_top_logprobs: int = 20  # alternatives a request may ask for per token (OpenAI's bound)
    max_schema_chars: int = 32768  # a response_format json_schema's JSON text
    # enum values, properties and anyOf branches of a schema or of the tools' (each candidate
    # token is weighed against them: reply/jsonschema.py schema_size)
    max_schema_values: int = 512
    idle_poll_s: float = 0.05  # the scheduler's sleep when it has nothing to do
    # Python's thread switch interval in the gateway's process (sys.setswitchinterval): the event
    # loop shares the GIL with constrained replies' token choices in worker threads; at the
    # default 5 ms each of its turns could wait that long behind one
    switch_interval_s: float = 0.0005
    max_requests_per_user: int = 8  # waiting + running at once; more are refused
    client_queue_frames: int = 1024  # frames queued for one client; a client this far behind is dropped
    client_send_timeout_s: float = 10.0  # a client that takes no frame for this long is dropped
    latency_window: int = 4096  # TTFT and inter-token samples kept per tier (the latest)
    rate_window_s: float = 10.0  # tokens/s in stats and /metrics: over this last stretch
    prefill_chunk_tokens: int = 64  # a prompt is prefilled this much per step, between decodes
    prefill_step_tokens: int = 64  # prefill tokens of all requests together in one step (>= 1 chunk)
    # beside running replies a step's chunk shrinks (to this at least) while such steps take
    # more than prefill_slowdown times a step of decode rows alone (serve/prefillpace.py)
    prefill_min_chunk_tokens: int = 8
    prefill_slowdown: float = 2.0
    # in a step of decodes alone, each reply goes on for up to this many more tokens without
    # waiting for the step's others, while no request waits and its KV fits (0: one a step):
    # a batch's waves then follow each other through the pipeline rather than meeting each token
    run_ahead_tokens: int = 7
    max_refused_in_a_row: int = 32  # a client refused more often than this in a row is cut off
    flood_cooldown_s: float = 5.0  # ... and its user may not connect again for this long
    # a client cut off still sending: what it sends is read and dropped for at most this long
    # after the last frame, so that its unread bytes do not reset the connection first
    close_linger_s: float = 2.0
    # a preempted request's KV goes to the KV stores and comes back when it resumes (else it
    # is recomputed)
    swap_preempted: bool = True
    # a new request imports the KV of the longest stored prefix of its prompt (a shared system
    # prompt, a conversation's earlier turns) instead of computing it, and a finished request's
    # KV is stored for the next; across users, as vLLM's prefix caching (timing can tell a
    # user that some request began with a prefix: turn it off where that matters)
    reuse_prefixes: bool = True
    # new requests' lookups wait at most this long for finished requests' KV still being
    # stored (a prompt extending one finds it); past it they look up without it
    store_wait_s: float = 2.0
    reconnect_interval_s: float = 2.0  # after a lost node, how often the plan is deployed again


@dataclass(frozen=True)
class SchedulerConfig:
    context_limit: int = 2048  # L
    a_prompt: float = 1.0
    a_output: float = 1.0
    a_decode: float = 1.0
    w_tier: float = 1.0  # third term per tier level (tiers 0 = lowest)
    patience_s: float = 2.0  # P, for tier 0
    tier_patience_scale: float = 1.0  # tier t is overdue after P * scale**t (< 1: sooner)
    slope: float = 1e6  # second term per overdue second: overdue beats any static difference
    max_requests: int = 8  # running at once (one decode step serves them all)
    fair_share: bool = True  # several users active: each runs at most max_requests // users
    fair_window_s: float = 2.0  # a user stays active this long after its last request ran
    max_step_tokens: int = 2048  # prefill tokens one step may admit
    kv_tokens: int = 8192  # KV memory, in tokens, for all running requests together
    max_preemptions: int = 2  # per request
    interval_s: float = 0.0  # minimum time between admissions
    kv_buckets: tuple[int, ...] = ()  # the nodes' KV capacities (RuntimeConfig); (): per token
    finished_window: int = 1024  # finished requests kept for inspection (the latest)
