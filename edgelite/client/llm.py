"""The library's front door: connect to a model (local, or split across nodes) and talk to it.

    async with edgelite.connect("models/smollm2-135m", nodes=["a:7070", "b:7070"],
                                token="...") as llm:
        print(llm.plan)
        async for piece in llm.chat([{"role": "user", "content": "Hi"}], max_tokens=64):
            print(piece.text, end="")

Without `nodes` every layer runs in this process. With nodes and no `split`, the client probes
every device and link, plans with HiGHS (or the exact DP) and deploys that plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgelite.client.backend import ClusterBackend, open_backend
from edgelite.client.failover import FailoverBackend, Recovery, Replan
from edgelite.client.local import LocalBackend
from edgelite.config import ClientConfig, GenerationConfig, RuntimeConfig, WireLimits
from edgelite.errors import AuthError, EdgeliteError
from edgelite.ids import NodeAddr, SessionId
from edgelite.manifest import Manifest
from edgelite.manifest import load as load_manifest
from edgelite.net import handshake
from edgelite.net.discovery import discover
from edgelite.net.linkprobe import ProbeConfig
from edgelite.net.routes import Routes
from edgelite.planner.model import Plan
from edgelite.planner.solve import plan as solve_plan
from edgelite.planner.solve import split_plan
from edgelite.planner.spec import KV_TOKENS
from edgelite.prober.cluster import cluster_spec, probe, without
from edgelite.reply.backend import Backend
from edgelite.reply.embed import embed
from edgelite.reply.generate import generate
from edgelite.reply.loop import Piece, Stats, check, constrained
from edgelite.reply.speculate import DraftModel, Pacer, Speculation
from edgelite.reply.tokenizer import StreamDecoder, Tokenizer

log = logging.getLogger(__name__)

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}
Progress = Callable[[str, str, int, int], None]  # (phase: probe | deploy, what, done, total)


@dataclass(frozen=True)
class PlanOptions:
    """How `connect` plans when it is not given a split."""

    objective: str = "latency"  # latency | throughput
    solver: str = "auto"  # auto | milp | milp-literal | milp-aggregated | dp
    client_first: bool = True  # the client holds layer 0 (privacy)
    client_memory_bytes: int | None = None  # the most this process may hold (None: the free memory)
    # tokens of KV room each layer is planned with (sessions beyond what a node then has room
    # for are refused there)
    context: int = KV_TOKENS
    # nodes were asked for and none can be used: run on this device alone (else an error)
    allow_local: bool = True
    probe: ProbeConfig = field(default_factory=ProbeConfig)


class Reply:
    """A streamed reply: iterate for Pieces; afterwards `text`, `token_ids` and `stats`."""

    def __init__(self, llm: LLM, prompt: list[int], cfg: GenerationConfig,
                 session: SessionId | None, reuse: bool = True) -> None:
        self.llm, self.prompt, self.cfg, self.session = llm, prompt, cfg, session
        self.reuse = reuse
        self.stats = Stats()
        self.text = ""

    @property
    def token_ids(self) -> list[int]:
        return self.stats.token_ids

    async def __aiter__(self) -> AsyncIterator[Piece]:
        gen = generate(self.llm.backend, self.prompt, self.cfg, self.stats, self.session,
                       self.reuse, StreamDecoder(self.llm.tokenizer), self.llm.speculation(self.cfg))
        try:
            async for piece in gen:
                self.text += piece.text
                yield piece
        finally:
            await gen.aclose()

    async def collect(self) -> str:
        """Run to the end; the reply's text."""
        async for _ in self:
            pass
        return self.text


class LLM:
    """A connected model. Use as an async context manager (or call `close`)."""

    def __init__(self, manifest: Manifest, backend: Backend, tokenizer: Tokenizer,
                 plan: Plan | None, probed: dict[str, Any] | None,
                 generation: GenerationConfig) -> None:
        self.manifest, self.backend, self.tokenizer = manifest, backend, tokenizer
        self._plan, self.probed, self.generation = plan, probed, generation
        self.draft: DraftModel | None = None  # a draft model (open_llm's `draft`)
        self.pacers: dict[str, Pacer] = {}  # speculation mode -> its pacer (learns across replies)

    def speculation(self, cfg: GenerationConfig) -> Speculation | None:
        """How a reply with these settings speculates (None: it does not; nor does a reply
        constrained to JSON or tools, whose tokens are chosen one by one)."""
        if cfg.speculate == "off" or constrained(cfg):
            return None
        if cfg.speculate not in ("lookup", "draft"):
            raise EdgeliteError(f"speculate={cfg.speculate!r}: one of off, lookup, draft")
        if cfg.speculate == "draft" and self.draft is None:
            raise EdgeliteError("speculate=draft needs a draft model: connect(..., draft=DIR) "
                                "(--speculate DIR)")
        pacer = self.pacers.get(cfg.speculate)
        if pacer is None:
            pr = self._plan.predicted if self._plan is not None else None
            pacer = self.pacers[cfg.speculate] = (
                Pacer(pr.expected, pr.compute) if pr is not None and math.isfinite(pr.expected)
                else Pacer())
        return Speculation(pacer, self.draft if cfg.speculate == "draft" else None)

    @property
    def plan(self) -> Plan | None:
        """The plan steps run on now (a failover replaces it)."""
        if isinstance(self.backend, FailoverBackend) and self.backend.generation:
            return self.backend.plan or _local_plan(self.manifest)
        return self._plan

    @property
    def recoveries(self) -> list[Recovery]:
        """The failovers so far, timed (empty without nodes or failover)."""
        return self.backend.recoveries if isinstance(self.backend, FailoverBackend) else []

    def _cfg(self, **overrides: Any) -> GenerationConfig:
        given = {k: v for k, v in overrides.items() if v is not None}
        if "stop" in given:
            given["stop"] = tuple(given["stop"])
        known = {f.name for f in dataclasses.fields(GenerationConfig)}
        if unknown := set(given) - known:
            raise EdgeliteError(f"unknown generation options {sorted(unknown)}; known: {sorted(known)}")
        return dataclasses.replace(self.generation, **given)

    def chat(self, messages: Sequence[Message], *, max_tokens: int | None = None,
             temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
             stop: Sequence[str] | None = None, session: SessionId | None = None,
             reuse: bool = True, speculate: str | None = None, **options: Any) -> Reply:
        """The assistant's next reply to `messages`, rendered with the model's chat template.
        `reuse`: the KV of the prompt's longest stored prefix is imported from the KV stores
        (e.g. the conversation so far), and the conversation's KV is stored afterwards.
        `speculate`: off, lookup or draft (GenerationConfig.speculate); `options`: any other
        GenerationConfig field (top_k, min_p, the penalties, logprobs, response_format, tools
        and tool_choice: a reply that calls a tool ends with finish "tool_calls" and the call
        in `stats.tool_call`)."""
        cfg = self._cfg(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                        stop=stop, speculate=speculate, **options)
        prompt = self.tokenizer.chat_prompt(list(messages), check(cfg).tools, cfg.tool_choice)
        return Reply(self, prompt, cfg, session, reuse)

    def complete(self, prompt: str | list[int], *, max_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None,
                 seed: int | None = None, stop: Sequence[str] | None = None,
                 session: SessionId | None = None, reuse: bool = True,
                 speculate: str | None = None, **options: Any) -> Reply:
        """A continuation of raw text (or token ids), without the chat template (`reuse`,
        `speculate`: as for chat)."""
        ids = self.tokenizer.text_prompt(prompt) if isinstance(prompt, str) else list(prompt)
        return Reply(self, ids, self._cfg(max_tokens=max_tokens, temperature=temperature,
                                          top_p=top_p, seed=seed, stop=stop, speculate=speculate,
                                          **options),
                     session, reuse)

    async def embed(self, text: str, chunk: int = 64) -> np.ndarray:
        """The text's embedding (reply/embed.py: the final hidden states, mean pooled and
        normalised), computed `chunk` tokens a step."""
        return await embed(self.backend, self.tokenizer.text_prompt(text), chunk)

    @property
    def cluster(self) -> ClusterBackend | None:
        """The deployed plan's cluster backend now (None when every layer runs here)."""
        inner = self.backend.inner if isinstance(self.backend, FailoverBackend) else self.backend
        return inner if isinstance(inner, ClusterBackend) else None

    async def node_stats(self) -> dict[NodeAddr, dict[str, Any]]:
        """Each node's stats ({} when running locally)."""
        cluster = self.cluster
        return await cluster.cluster.stats() if cluster is not None else {}

    async def close(self) -> None:
        await self.backend.close()
        if self.draft is not None:
            await self.draft.close()

    async def __aenter__(self) -> LLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def open_llm(model: str | Path | Manifest, nodes: Sequence[str | NodeAddr] | str | None = None,
                   token: str | None = None, *, split: Sequence[tuple[int, int]] | None = None,
                   plan: Plan | None = None, planning: PlanOptions | None = None,
                   routes: Routes | None = None, runtime: RuntimeConfig | None = None,
                   client: ClientConfig | None = None, generation: GenerationConfig | None = None,
                   progress: Progress | None = None, draft: str | Path | None = None) -> LLM:
    """Load the manifest, plan (probe + solve, unless `split` or `plan` is given), deploy.
    `draft`: a draft model's folder, for speculative decoding (GenerationConfig.speculate
    "draft"): a small export with the same tokenizer, run on this device."""
    manifest = model if isinstance(model, Manifest) else load_manifest(model)
    tokenizer = Tokenizer(manifest)
    drafter = open_draft(draft, manifest, tokenizer, runtime) if draft is not None else None
    token = token or os.environ.get("EDGELITE_TOKEN")
    addrs = await node_addrs(nodes, token, client or ClientConfig())
    probed = None
    if plan is None and split is not None:
        plan = split_plan(list(split), addrs, manifest.num_layers)
    elif plan is None and addrs:
        if token is None:
            raise EdgeliteError("the cluster token is needed: pass token= (or set EDGELITE_TOKEN; "
                                "each node prints it when it starts)")
        opts = planning or PlanOptions()
        runtime_threads = (runtime or RuntimeConfig()).threads
        probed = await probe(addrs, token, manifest, opts.probe, routes=routes,
                             client_memory_bytes=opts.client_memory_bytes,
                             client_threads=runtime_threads,
                             client_matmul_kernel=(runtime or RuntimeConfig()).matmul_kernel,
                             progress=_phase(progress, "probe"), client_cfg=client)
        gone = [d for d in probed["devices"][1:] if not d.get("reachable", True)]
        if not opts.allow_local and len(gone) == len(addrs):
            raise EdgeliteError(f"no node could be used ({'; '.join(d['reason'] for d in gone)}); "
                                f"--allow-local runs on this device alone")
        plan = solve_plan(manifest, cluster_spec(probed), opts.objective, opts.solver,
                          opts.client_first, opts.context, chunks=(runtime or RuntimeConfig()).plan_chunks)
    plan = plan or _local_plan(manifest)
    backend = await open_backend(manifest, plan, token, client, runtime, routes,
                                 _phase(progress, "deploy"))
    ccfg = client or ClientConfig()
    if plan.remote and ccfg.failover:
        replan = _replanner(manifest, addrs, token, probed, planning or PlanOptions(), ccfg,
                            runtime, routes, plan)
        backend = FailoverBackend(manifest, backend, replan, ccfg, _answers(token, ccfg))
    log.info("ready: %s (%s, %s) with %s", manifest.name, manifest.weights, manifest.compute,
             ", ".join(f"layers {s.first}-{s.last} on {s.addr or 'this device'}"
                       for s in plan.stages))
    llm = LLM(manifest, backend, tokenizer, plan, probed, generation or GenerationConfig())
    llm.draft = drafter
    return llm


def open_draft(folder: str | Path, target: Manifest, tokenizer: Tokenizer,
               runtime: RuntimeConfig | None) -> DraftModel:
    """A draft model for `target`: refused unless its tokenizer gives the same ids."""
    manifest = load_manifest(folder)
    theirs = Tokenizer(manifest)
    if (theirs.tok.get_vocab() != tokenizer.tok.get_vocab()
            or set(manifest.eos_token_ids) != set(target.eos_token_ids)):
        raise EdgeliteError(f"the draft model {manifest.name} ({folder}) has another tokenizer "
                            f"than {target.name}: its drafts would be other tokens")
    return DraftModel(LocalBackend(manifest, runtime))


def _answers(token: str | None, cfg: ClientConfig) -> Callable[[NodeAddr], Awaitable[bool]]:
    """Whether a node answers now: a handshake with the cluster token, then closed."""
    async def answers(addr: NodeAddr) -> bool:
        try:
            conn, _ = await handshake.connect(addr, token or "", None, WireLimits(),
                                             cfg.connect_timeout_s)
        except (ConnectionError, AuthError):
            return False
        await conn.close()
        return True
    return answers


async def node_addrs(nodes: Sequence[str | NodeAddr] | str | None, token: str | None,
                     client: ClientConfig) -> list[NodeAddr]:
    """The nodes' addresses; "auto": the nodes of this cluster that answer on the LAN."""
    if nodes != "auto":
        return [a if isinstance(a, NodeAddr) else NodeAddr.parse(a) for a in nodes or []]
    if token is None:
        raise EdgeliteError("--nodes auto needs the cluster token (token= or EDGELITE_TOKEN): "
                            "only nodes with that token answer")
    cfg = client.discovery
    found = await discover(token, cfg)
    if not found:
        raise EdgeliteError(f"no node answered within {cfg.wait_s:g} s (UDP port {cfg.port}, "
                            f"broadcast to {', '.join(cfg.broadcast)}): are the nodes running, on "
                            f"this network, with the same token?")
    log.info("found %s", ", ".join(f"{f.name} at {f.addr}" for f in found))
    return [f.addr for f in found]


def _replanner(manifest: Manifest, addrs: list[NodeAddr], token: str | None,
               probed: dict[str, Any] | None, opts: PlanOptions, client: ClientConfig,
               runtime: RuntimeConfig | None, routes: Routes | None, first: Plan) -> Replan:
    """How a failover plans and deploys again without some nodes: the planner on the last
    probe without them (the running plan `first`, then the last one deployed, kept in place
    with a spare for each lost node where that is near the best), or (a fixed split, nothing
    probed) the layers spread evenly over the nodes left, or everything here when none is left."""

    running = [first]  # the plan deployed now

    def solved(spec: dict[str, Any], before: Plan | None) -> Plan:
        return solve_plan(manifest, spec, opts.objective, opts.solver, opts.client_first,
                          opts.context, chunks=(runtime or RuntimeConfig()).plan_chunks,
                          before=before, slack=client.failover_keep_slack)

    async def replan(gone: frozenset[NodeAddr]) -> tuple[Backend, float, float]:
        t0 = time.monotonic()
        alive = [a for a in addrs if a not in gone]
        spec: dict[str, Any] | None = None
        if probed is not None:  # (a kept range is shared with the old plan while it unloads)
            spec = cluster_spec(without(probed, {str(a) for a in gone}))
            plan = solved(spec, running[0])
        elif alive:
            cuts = np.array_split(np.arange(manifest.num_layers), len(alive))
            plan = split_plan([(int(c[0]), int(c[-1])) for c in cuts], alive, manifest.num_layers)
        else:
            plan = _local_plan(manifest)
        t1 = time.monotonic()
        try:
            backend = await open_backend(manifest, plan, token, client, runtime, routes)
        except EdgeliteError as exc:
            if spec is None or plan.solver != "in place":
                raise
            log.info("the plan keeping the layers in place did not deploy (%s): planning afresh", exc)
            plan = solved(spec, None)
            backend = await open_backend(manifest, plan, token, client, runtime, routes)
        running[0] = plan
        return backend, (t1 - t0) * 1e3, (time.monotonic() - t1) * 1e3

    return replan


def _local_plan(manifest: Manifest) -> Plan:
    from edgelite.planner.model import Stage

    return Plan((Stage("client", 0, manifest.num_layers - 1),), "latency", "local", "local")


def _phase(progress: Progress | None, phase: str) -> Callable[[str, int, int], None] | None:
    if progress is None:
        return None
    return lambda what, done, total: progress(phase, what, done, total)


class connect:
    """`await edgelite.connect(...)` or `async with edgelite.connect(...) as llm` (closed on
    exit). Arguments as `open_llm`."""

    def __init__(self, model: str | Path | Manifest, nodes: Sequence[str | NodeAddr] | str | None = None,
                 token: str | None = None, **kwargs: Any) -> None:
        self._args = (model, nodes, token)
        self._kwargs = kwargs
        self._llm: LLM | None = None

    def __await__(self) -> Generator[Any, None, LLM]:
        return open_llm(*self._args, **self._kwargs).__await__()

    async def __aenter__(self) -> LLM:
        self._llm = await open_llm(*self._args, **self._kwargs)
        return self._llm

    async def __aexit__(self, *exc: object) -> None:
        if self._llm is not None:
            await self._llm.close()
