"""/metrics: the gateway's figures in Prometheus's text format."""

from __future__ import annotations

from edgelite.serve.gateway import Gateway


def prometheus(gw: Gateway | None, requests_total: int, disconnects: int) -> str:
    """`gw` None: not deployed yet; the HTTP door's own counts beside the gateway's."""
    lines: list[str] = []

    def metric(name: str, kind: str, helptext: str, values: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP edgelite_{name} {helptext}")
        lines.append(f"# TYPE edgelite_{name} {kind}")
        lines.extend(f"edgelite_{name}{labels} {value:g}" for labels, value in values)

    metric("up", "gauge", "1 when the plan is deployed and requests can run",
           [("", 1.0 if gw is not None and gw.ready else 0.0)])
    metric("http_requests_total", "counter", "completion requests accepted over HTTP",
           [("", requests_total)])
    metric("http_disconnects_total", "counter", "HTTP requests whose client left before the end",
           [("", disconnects)])
    if gw is None:
        return "\n".join(lines) + "\n"
    st = gw.stats()
    metric("queue_length", "gauge", "requests per queue and tier",
           [(f'{{queue="{q}",tier="{t}"}}', n) for t, qs in st["queues_by_tier"].items()
            for q, n in qs.items()])
    metric("requests_cancelled_total", "counter", "requests whose client went away",
           [("", st["cancelled"])])
    metric("preemptions_total", "counter", "requests preempted (KV dropped)",
           [(f'{{tier="{t}"}}', ts["preemptions"]) for t, ts in st["tiers"].items()])
    metric("requests_done_total", "counter", "requests finished",
           [(f'{{tier="{t}"}}', ts["done"]) for t, ts in st["tiers"].items()])
    metric("tokens_total", "counter", "tokens generated", [("", st["tokens_total"])])
    metric("node_losses_total", "counter", "plans made again without a node taken for lost",
           [("", st["reconnects"] + st["recoveries"])])
    metric("rejoins_total", "counter", "times nodes left out were planned in again",
           [("", st["rejoins"])])
    metric("tokens_per_second", "gauge", f"tokens generated per second over the last "
           f"{gw.cfg.rate_window_s:g} s", [("", st["tokens_per_s"])])
    metric("kv_tokens_used", "gauge", "KV positions held by running requests",
           [("", st["kv_tokens"]["used"])])
    metric("kv_tokens_budget", "gauge", "KV positions the scheduler may charge in all",
           [("", st["kv_tokens"]["budget"])])
    metric("kv_tokens_charged_max", "gauge", "the most KV positions one running request is charged",
           [("", max(st["kv_tokens"]["charged"], default=0))])
    metric("batch_size", "gauge", "requests run together per step (recent steps)",
           [('{stat="mean"}', st["batch"]["mean"]), ('{stat="max"}', st["batch"]["max"])])
    for what, key in (("ttft", "ttft_ms"), ("inter_token", "itl_ms"), ("queue_wait", "queue_wait_ms")):
        metric(f"{what}_ms", "summary", f"{what.replace('_', '-')} latency per tier (recent)",
               [(f'{{tier="{t}",quantile="{q}"}}', ts[f"{key}_p{p}"])
                for t, ts in st["tiers"].items() for q, p in (("0.5", 50), ("0.99", 99))])
    return "\n".join(lines) + "\n"
