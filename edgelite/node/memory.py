"""A node's memory rules: what layers and KV it may take on, within `--memory-mb` (the whole
process), its KV budget, and each client address's share of that budget. Pure checks on
figures; the store (stages.py) supplies what is held now.

Memory that tells the truth, end to end: the exporter measures what each piece holds once
loaded (exporter/resident.py: each kind of layer, the embedding and the head loaded three
times in a process of their own, the growth after the first averaged; a layer's scratch is
the peak above that while a 256-token chunk runs) into the manifest (`resident_bytes`,
`scratch_bytes`; unmeasured: weights x 2.2 and an estimate from the hidden size), and where
the exporting machine runs every product kind the export lists in edgelite's operators, the
same measured with them (`narrow_*`). Each device says whether it does (`narrow_products` in
its profile, from engine/passes/linear.py `narrow`, the same test this module's load check
is given), and the planner counts a layer there at its narrow figure (`Layer.narrow_mem_bytes`;
the client's embedding and head too). A budget (`--memory-mb`, `--client-memory-mb`) bounds
the whole process: the probe reports each process's resident set, and the planner gives a
device its budget less that, less one chunk's scratch, and counts each layer as what it holds
plus its KV for `--context` tokens; where the layers do not fit beside a 256-token chunk's
scratch it tries smaller chunks (64, 16) and the plan records the largest that fits
(`Plan.max_chunk`, which each node is told and enforces). A node refuses a load that would
take it over its budget (`Limits.fits`, before; `held`, after, with the real figure) and a
session or KV growth beyond it (`admit`, called by StageStore)."""

from __future__ import annotations

from dataclasses import dataclass

from edgelite import manifest as mf
from edgelite.errors import EdgeliteError, KVBudgetExceeded

MIB = 2**20


@dataclass(frozen=True)
class Limits:
    kv_budget_bytes: int
    # the most this process may hold (--memory-mb); None: no bound of its own
    memory_budget_bytes: int | None = None
    # the most of the KV budget the clients of one address may hold together (client keys
    # are chosen freely: a share per key would let one holder take it all with two keys)
    max_address_kv_share: float = 1.0
    max_sessions_per_client: int = 64

    def fits(self, m: mf.Manifest, first: int, last: int, now: int | None, scratch: int,
             narrow: bool = False) -> None:
        """Refuse, before loading, layers that would take this process over its memory
        budget: what they hold once loaded (as the exporter measured it; `narrow`: with
        edgelite's product operators) and a prompt chunk's `scratch`, on top of what the process
        holds `now`."""
        budget = self.memory_budget_bytes
        if budget is None or now is None:
            return
        need = m.resident(first, last, narrow)
        if now + need + scratch > budget:
            raise EdgeliteError(
                f"load: layers {first}-{last} of {m.name} hold {need / MIB:.0f} MiB once loaded "
                f"and a prompt chunk {scratch / MIB:.0f} MiB more; this node holds "
                f"{now / MIB:.0f} MiB and its --memory-mb is {budget / MIB:.0f}: "
                f"{(now + need + scratch - budget) / MIB:.0f} MiB short")

    def held(self, m: mf.Manifest, first: int, last: int, now: int | None, scratch: int) -> None:
        """After loading: the same bound on what the process holds `now` (the measured
        figure came from another machine)."""
        budget = self.memory_budget_bytes
        if budget is not None and now is not None and now + scratch > budget:
            raise EdgeliteError(
                f"load: with layers {first}-{last} of {m.name} loaded this node holds "
                f"{now / MIB:.0f} MiB, and a prompt chunk needs {scratch / MIB:.0f} MiB more: "
                f"over its --memory-mb of {budget / MIB:.0f}; they were unloaded")

    def admit(self, session: str, grow: int, used: int, address: str, theirs: int,
              now: int | None, scratch: int) -> None:
        """Refuse KV growth of `grow` bytes beyond the KV budget (`used` of it in use), the
        address's share of it (`theirs` held there) or the memory budget (`now` held)."""
        if used + grow > self.kv_budget_bytes:
            raise KVBudgetExceeded(f"session {session[:12]}: KV needs {grow} more bytes, "
                                   f"{self.kv_budget_bytes - used} of the node's "
                                   f"{self.kv_budget_bytes} left")
        cap = self.address_budget_bytes
        if theirs + grow > cap:
            raise KVBudgetExceeded(f"session {session[:12]}: KV needs {grow} more bytes; the clients "
                                   f"at {address or 'this address'} hold {theirs} of the "
                                   f"node's {self.kv_budget_bytes}, at most {cap} "
                                   f"(max_address_kv_share): the rest stays for others")
        budget = self.memory_budget_bytes
        if budget is not None and now is not None and now + grow + scratch > budget:
            raise KVBudgetExceeded(f"session {session[:12]}: KV needs {grow / MIB:.1f} MiB more; "
                                   f"this node holds {now / MIB:.0f} MiB of its --memory-mb "
                                   f"{budget / MIB:.0f} (a prompt chunk needs "
                                   f"{scratch / MIB:.0f} MiB of room)")

    def admit_session(self, held: int) -> None:
        """Refuse a new session of a client that holds `held` sessions here already."""
        if held >= self.max_sessions_per_client:
            raise KVBudgetExceeded(f"this client holds {held} sessions on this node; the "
                                   f"limit is {self.max_sessions_per_client}")

    @property
    def address_budget_bytes(self) -> int:
        """The KV one address's clients may hold together."""
        return int(min(1.0, self.max_address_kv_share) * self.kv_budget_bytes)
