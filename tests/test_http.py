"""The OpenAI-compatible HTTP API: `edgelite serve --http` on 2 node processes, driven by the
official `openai` package and by `curl -N`."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from conftest import run_cli
from edgelite.cli.localnodes import TOKEN, start_serve, stop_serve, wait_healthy
from edgelite.config import HttpConfig
from edgelite.reply.jsonprefix import JsonPrefix
from edgelite.reply.jsonschema import fits
from edgelite.reply.loop import StopMatcher
from edgelite.serve.http import HttpApi, served
from models import as_if_large

pytestmark = pytest.mark.e2e
USERS = [{"name": "free", "token": "t-free", "tier": 0}, {"name": "pro", "token": "t-pro", "tier": 2}]
PROMPTS = ["hello", "tell me a story", "what is a phone", "count to five"]


def _start(model: Path, nodes: list, users: Path, log, *extra: str) -> tuple[subprocess.Popen, str]:
    proc, found = start_serve(["--model", str(model), "--nodes", ",".join(n.addr for n in nodes),
                               "--split", "0-0,1-2", "--token", TOKEN, "--users", str(users),
                               "--http", "127.0.0.1:0", "--no-native", "--threads", "1",
                               "--patience-s", "5", *extra], log, r"listening on (http://[\d.]+:\d+)/v1")
    base = found.group(1)
    if wait_healthy(base, 60):
        return proc, base
    proc.kill()
    raise AssertionError("the HTTP API never became healthy (see its log)")


def _metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines()
                                     if ln and not ln.startswith("#"))}


@pytest.fixture
def server(exported, node_factory, tmp_path: Path, request):
    nodes = [node_factory() for _ in range(2)]
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"users": USERS}))
    log = tmp_path / "serve.log"
    with log.open("w") as f:
        proc, base = _start(exported["llama"], nodes, users, f,
                            "--set", "max_requests_per_user=12", *getattr(request, "param", ()))
    yield base, log
    stop_serve(proc)
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]


def test_openai_package_streams_and_answers_like_generate(exported, server) -> None:
    base, _ = server
    with openai.OpenAI(base_url=base + "/v1", api_key="t-pro", max_retries=0) as client:
        model = client.models.list().data[0].id
        solo = json.loads(run_cli("generate", "--model", str(exported["llama"]), "--json",
                                  "--max-tokens", "12", PROMPTS[1]).stdout)
        msgs = [{"role": "user", "content": PROMPTS[1]}]
        whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
        assert whole.model_extra["edgelite"]["token_ids"] == solo["token_ids"]
        assert whole.choices[0].message.content == solo["text"]
        assert whole.usage.completion_tokens == len(solo["token_ids"])
        assert whole.usage.prompt_tokens > 0 and whole.choices[0].finish_reason in ("length", "stop")

        pieces, finish, usage = [], None, None
        for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=12,
                                                    temperature=0, stream=True):
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        assert "".join(pieces) == solo["text"] and finish == whole.choices[0].finish_reason
        assert usage is not None and usage.completion_tokens == len(solo["token_ids"])

        # /v1/completions: the raw prompt, no chat template; a stop string cuts the text
        text = client.completions.create(model=model, prompt="the sky is", max_tokens=10).choices[0].text
        assert text
        stop = text[2:4]
        cut = client.completions.create(model=model, prompt="the sky is", max_tokens=10, stop=[stop])
        assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
        # a seed makes sampling repeatable
        a, b = (client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=1.0,
                                               seed=7).choices[0].message.content for _ in range(2))
        assert a == b

        # errors: OpenAI's JSON and status codes
        with pytest.raises(openai.AuthenticationError):
            with openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0) as stranger:
                stranger.models.list()
        with pytest.raises(openai.NotFoundError, match="not served here"):
            client.chat.completions.create(model="gpt-9", messages=msgs)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.chat.completions.create(model=model, messages=msgs, temperature=9)
        with pytest.raises(openai.BadRequestError, match="n=1"):
            client.chat.completions.create(model=model, messages=msgs, n=2)
        with pytest.raises(openai.BadRequestError, match="messages"):
            client.chat.completions.create(model=model, messages=[])


@pytest.mark.parametrize("server", [("--http-set", "sse_keepalive_s=0.001")], indirect=True)
def test_curl_streams_server_sent_events(server) -> None:
    """(Keep-alive comments every ms while nothing else is ready: the prefill is one.)"""
    base, _ = server
    body = json.dumps({"model": "ignored-not", "messages": [{"role": "user", "content": "hi"}]})
    bad = subprocess.run(["curl", "-sS", "-N", "-H", "Authorization: Bearer t-free", "-H",
                          "Content-Type: application/json", "-d", body, "-w", "\n%{http_code}",
                          base + "/v1/chat/completions"], capture_output=True, text=True, timeout=30)
    assert bad.stdout.endswith("404") and '"model_not_found"' in bad.stdout
    # hostile bodies: too large, not JSON, a field of the wrong type: one error each
    for data, code, what in ((b"{" + b" " * (400 << 10) + b"}", 413, "exceeds"),
                             (b"\xff not json", 400, "not JSON"),
                             (json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": "many"}).encode(), 400, "max_tokens")):
        req = urllib.request.Request(base + "/v1/chat/completions", data=data, headers={
            "Authorization": "Bearer t-free", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == code and what in json.loads(err.value.read())["error"]["message"]
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                       "max_tokens": 6})
    out = subprocess.run(["curl", "-sS", "-N", "-H", "Authorization: Bearer t-free", "-H",
                          "Content-Type: application/json", "-d", body, base + "/v1/chat/completions"],
                         capture_output=True, text=True, timeout=30)
    assert ": keep-alive" in out.stdout.split("data: ", 2)[1]  # before the first token
    events = [ln[len("data: "):] for ln in out.stdout.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", out.stdout
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 6 == len(chunks[-1]["edgelite"]["token_ids"])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


# the streams are compared with the solo runs token for token, so each computes its whole
# prompt: with reuse_prefixes a prompt whose prefix came from the store computes its tail in
# other shapes, and that can flip a near tie of this random model (ids then depend on what
# ran before, as for any prefix cache)
@pytest.mark.parametrize("server", [("--set", "reuse_prefixes=false")], indirect=True)
def test_sixteen_streams_match_solo_runs_and_tiers_show(server) -> None:
    base, _ = server

    async def one(user: str, prompt: str) -> list[int]:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=user, max_retries=0)
        ids: list[int] = []
        model = (await client.models.list()).data[0].id
        async for chunk in await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0,
                stream=True):
            if chunk.model_extra.get("edgelite"):
                ids = chunk.model_extra["edgelite"]["token_ids"]
        await client.close()
        return ids

    async def main() -> tuple[list[list[int]], list[list[int]]]:
        solo = [await one("t-pro", p) for p in PROMPTS]
        many = await asyncio.gather(*(one("t-pro" if i % 2 else "t-free", PROMPTS[i % 4])
                                      for i in range(16)))
        return solo, list(many)

    solo, many = asyncio.run(asyncio.wait_for(main(), 120))
    assert all(len(s) == 16 for s in solo)
    for i, ids in enumerate(many):
        assert ids == solo[i % 4], i
    m = _metrics(base)
    assert m['edgelite_requests_done_total{tier="2"}'] == 4 + 8
    assert m['edgelite_requests_done_total{tier="0"}'] == 8
    # tier order: the 8 tier-2 streams were admitted before the 8 tier-0 ones
    assert m['edgelite_ttft_ms{tier="2",quantile="0.5"}'] < m['edgelite_ttft_ms{tier="0",quantile="0.5"}']
    assert m['edgelite_queue_length{queue="running",tier="0"}'] == 0
    assert m["edgelite_tokens_total"] == (4 + 16) * 16
    # (issue 65) steps ran several requests together; the tier-0 streams waited in the queue
    # behind the tier-2 ones; nothing runs now, so no KV is charged
    assert m['edgelite_batch_size{stat="max"}'] >= 2
    assert m['edgelite_queue_wait_ms{tier="0",quantile="0.99"}'] > 0
    assert m["edgelite_kv_tokens_charged_max"] == 0 and m["edgelite_kv_tokens_budget"] > 0


def test_a_prompt_over_the_native_doors_limit_is_refused_before_tokenizing(server) -> None:
    """The HTTP door takes the native door's max_prompt_chars (131,072): a longer prompt, chat
    or completion, is a 400 naming the limit, at once; the server serves the next request."""
    base, _ = server
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "x" * 140_000}]}),
                       ("/v1/completions", {"prompt": "y" * 140_000})):
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={
            "Authorization": "Bearer t-free", "Content-Type": "application/json"})
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        message = json.loads(err.value.read())["error"]["message"]
        assert err.value.code == 400 and "max_prompt_chars" in message and "140000" in message
        assert time.monotonic() - t0 < 2
    assert _metrics(base)["edgelite_up"] == 1
    with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=5) as r:
        assert json.loads(r.read()) == {"status": "ok"}  # (a stranger learns nothing of the nodes)
    req = urllib.request.Request(base.removesuffix("/v1") + "/health",
                                 headers={"Authorization": "Bearer t-free"})
    with urllib.request.urlopen(req, timeout=5) as r:
        health = json.loads(r.read())
    # /health says a user where the layers run (a gateway in the background shows its plan there)
    assert [st["layers"] for st in health["plan"]] == [[0, 0], [1, 2]], health
    assert all(st["addr"] for st in health["plan"]), health
    # streams read to [DONE] (one ended by a stop string) are not disconnects
    for extra in ({}, {"stop": ["e"]}):
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                           "max_tokens": 6, **extra}).encode()
        req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={
            "Authorization": "Bearer t-free", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.read().rstrip().endswith(b"data: [DONE]")
    time.sleep(0.3)
    assert _metrics(base)["edgelite_http_disconnects_total"] == 0


def test_a_client_that_disconnects_frees_its_request(server) -> None:
    base, _ = server
    body = json.dumps({"messages": [{"role": "user", "content": "go on"}], "stream": True,
                       "max_tokens": 230}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={
        "Authorization": "Bearer t-free", "Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=30)
    assert resp.readline().startswith(b"data: ")  # the stream began
    resp.close()  # and the client hangs up
    gone = time.monotonic()
    while time.monotonic() - gone < 1.0:
        m = _metrics(base)
        if (m["edgelite_requests_cancelled_total"] == 1
                and m['edgelite_queue_length{queue="running",tier="0"}'] == 0):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the request still runs 1 s after its client left: {m}")
    assert m["edgelite_http_disconnects_total"] == 1
    assert m["edgelite_tokens_total"] < 230


def test_health_is_503_until_deployed_and_stops_hold_back_text() -> None:
    async def main() -> int:
        api = HttpApi("m", None, HttpConfig(port=0))
        async with served(api) as port:
            def get() -> int:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                        return r.status
                except urllib.error.HTTPError as exc:
                    return exc.code
            return await asyncio.to_thread(get)

    assert asyncio.run(main()) == 503
    s = StopMatcher(("END", "\n\n"))
    out = [s.push(t) for t in ("he", "llo E", "N", "D more")]
    assert "".join(t for t, _ in out) == "hello " and out[-1][1] and not out[1][1]


def test_idle_slow_and_surplus_connections_are_closed_and_bad_bodies_are_400s() -> None:
    """Connections that send nothing, or their headers a byte at a time, are closed within
    header_timeout_s; beyond max_connections they are closed as they come; meanwhile a real
    request is answered. A body of JSON nested 200,000 deep, or a Content-Length that is not
    a number, gets a 400 with OpenAI's error JSON (not a 500 with a traceback)."""
    cfg = HttpConfig(port=0, header_timeout_s=1.0, max_connections=40)

    async def main() -> None:
        api = HttpApi("m", None, cfg)
        async with served(api) as port:
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(60)]
            slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
            t0 = time.monotonic()

            async def closed(r: asyncio.StreamReader) -> float:
                assert await asyncio.wait_for(r.read(), 5) == b""
                return time.monotonic() - t0

            async def dribble() -> None:
                for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":
                    if slow_w.is_closing():
                        return
                    slow_w.write(bytes([b]))
                    await asyncio.sleep(0.1)

            drip = asyncio.create_task(dribble())
            # (the surplus goes at once; a request still gets in after the idle ones go)
            times = await asyncio.gather(*(closed(r) for r, _ in idle), closed(slow_r))
            drip.cancel()
            assert sum(t < 0.5 for t in times) >= 20 and max(times) < 3, times
            for _, w in idle:
                w.close()
            slow_w.close()
            status, body = await asyncio.to_thread(_post_when_in, port, b"[" * 200_000)
            assert status == 400 and "nested too deeply" in body["error"]["message"], body
            status, body = await asyncio.to_thread(_post, port, b"{}", {"Content-Length": "x1"})
            assert status == 400, body  # (h11 refuses it before the app sees it)

    asyncio.run(main())


def _post_when_in(port: int, data: bytes) -> tuple[int, dict]:
    """_post once the server has a connection free: it counts closed ones out as it notices
    them, so a connection made just after others closed may still be turned away (reset)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return _post(port, data)
        except ConnectionResetError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _post(port: int, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.putrequest("POST", "/v1/chat/completions")
        c.putheader("Content-Type", "application/json")
        for k, v in {"Content-Length": str(len(data)), **(headers or {})}.items():
            c.putheader(k, v)
        c.endheaders(data)
        r = c.getresponse()
        raw = r.read()
        return r.status, (json.loads(raw) if r.getheader("content-type") == "application/json"
                          else {"text": raw.decode(errors="replace")})
    finally:
        c.close()


def test_the_cluster_page_and_its_figures(exported, node_factory, tmp_path: Path) -> None:
    """GET / is one self-contained page (nothing fetched from elsewhere, its script parses);
    /v1/cluster needs a user's token and shows the probed devices and links, the plan's
    stages with predicted and measured times, and the gateway's per-tier figures."""
    nodes = [node_factory() for _ in range(2)]
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"users": USERS}))
    with (tmp_path / "serve.log").open("w") as log:
        # (a manifest that says each layer holds 2,000 MiB: the client has room for one)
        model = as_if_large(exported["llama"], tmp_path / "big")
        proc, found = start_serve(["--model", str(model), "--nodes",
                                   ",".join(n.addr for n in nodes), "--token", TOKEN,
                                   "--users", str(users), "--http", "127.0.0.1:0", "--no-native",
                                   "--threads", "1", "--client-memory-mb", "2000"],
                                  log, r"listening on (http://[\d.]+:\d+)/v1.*page and a chat: (\S+)")
    base = found.group(1)
    assert found.group(2) == base + "/"  # (serve says where the page is)
    try:
        with urllib.request.urlopen(base + "/", timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/html")
            page = r.read().decode()
        assert "<title>edgelite cluster</title>" in page and "/v1/chat/completions" in page
        # settings a chat page has (issue 66): a system prompt, max tokens, temperature, a new
        # chat; the conversation kept across a reload
        for control in ('id="system"', 'id="max-tokens"', 'id="temperature"', 'id="new-chat"'):
            assert control in page, control
        assert 'localStorage.setItem("edgelite-chat"' in page and "body.max_tokens" in page
        assert re.search(r"(src|href)=\"?(https?:)?//", page) is None  # no CDN, no other host
        script = page.split("<script>", 1)[1].split("</script>", 1)[0]
        (tmp_path / "page.js").write_text(script)
        if shutil.which("node"):
            check = subprocess.run(["node", "--check", str(tmp_path / "page.js")],
                                   capture_output=True, text=True, timeout=30)
            assert check.returncode == 0, check.stderr
        deadline = time.monotonic() + 60
        while True:  # 401 without a token; 503 until the plan is deployed
            try:
                urllib.request.urlopen(base + "/v1/cluster", timeout=10)
                raise AssertionError("/v1/cluster answered without a token")
            except urllib.error.HTTPError as exc:
                assert exc.code in (401, 503), exc.code
                if exc.code == 401:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.2)
        auth = {"Authorization": "Bearer t-pro"}
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6})
        while True:
            try:
                with urllib.request.urlopen(urllib.request.Request(
                        base + "/v1/chat/completions", data=body.encode(),
                        headers={**auth, "Content-Type": "application/json"}), timeout=60):
                    break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and time.monotonic() < deadline, exc.code
                time.sleep(0.2)
        with urllib.request.urlopen(urllib.request.Request(base + "/v1/cluster", headers=auth),
                                    timeout=10) as r:
            view = json.loads(r.read())
        # a node killed: the view says so within seconds (it showed the start-up probe)
        nodes[1].kill()
        killed = nodes[1].addr
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(urllib.request.Request(base + "/v1/cluster", headers=auth),
                                            timeout=10) as r:
                    after = json.loads(r.read())
            except urllib.error.HTTPError as exc:
                assert exc.code == 503, exc.code
                after = {}
            gone = [d for d in after.get("devices", []) if d.get("addr") == killed]
            if gone and gone[0]["reachable"] is not True:
                break
            assert time.monotonic() < deadline, (killed, after.get("devices"), after.get("plan"))
            time.sleep(0.5)
    finally:
        stop_serve(proc)
    assert view["ready"] and view["model"]["layers"] == 3
    assert {d["name"] for d in view["devices"]} >= {"client"} and len(view["devices"]) == 3
    assert len(view["links"]) >= 4 and all(ln["latency_ms"] is None or ln["latency_ms"] >= 0
                                           for ln in view["links"])
    stages = view["plan"]["stages"]
    assert sum(s["layers"][1] - s["layers"][0] + 1 for s in stages) == 3
    assert view["plan"]["expected_ms_per_token"] > 0
    remote = [s for s in stages if s["addr"] is not None]
    assert remote and all(s["measured_ms_per_run"] is not None for s in remote)
    assert view["gateway"]["tiers"]["2"]["done"] == 1
    assert all(d["reachable"] for d in view["devices"] if d.get("addr"))  # (before the kill)
    assert gone[0]["reason"] in ("does not answer now", "lost: the plan goes on without it") or \
        gone[0]["reason"].startswith("no plan now: "), gone


def _post_json(base: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer t-pro"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_json_object_replies_over_http(server) -> None:
    """A reply is a JSON object's prefix, a whole object when it ends by itself; with a schema
    it stays within it; schemas outside the subset and other formats are a 400 naming why."""
    base, _ = server
    for temperature in (0.0, 0.9):
        for prompt in ("give me json", "a person as a JSON object"):
            status, out = _post_json(base, {"messages": [{"role": "user", "content": prompt}],
                                       "max_tokens": 40, "temperature": temperature, "seed": 1,
                                       "response_format": {"type": "json_object"}})
            assert status == 200, out
            choice = out["choices"][0]
            text = choice["message"]["content"]
            state = JsonPrefix()
            assert state.feed(text), text
            if choice["finish_reason"] == "stop":
                assert state.done and isinstance(json.loads(text), dict), text
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"},
                                               "mood": {"enum": ["happy", "sad"]}},
              "required": ["name", "age", "mood"]}
    for temperature in (0.0, 0.9):
        status, out = _post_json(base, {
            "messages": [{"role": "user", "content": "a person"}], "max_tokens": 60,
            "temperature": temperature, "seed": 2,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": schema}}})
        assert status == 200, out
        choice = out["choices"][0]
        text = choice["message"]["content"]
        assert JsonPrefix().feed(text) and fits(schema, text), text
        if choice["finish_reason"] == "stop":
            got = json.loads(text)
            assert set(got) == {"name", "age", "mood"} and isinstance(got["age"], int), got
            assert got["mood"] in ("happy", "sad"), got
    deep: dict = {"type": "object"}
    for _ in range(20):
        deep = {"type": "object", "properties": {"a": deep}}
    for fmt, words in (({"type": "json_schema", "json_schema": {"schema": {
                            "type": "object", "properties": {"a": {"format": "date"}}}}},
                        "keyword 'format' is not supported"),
                       ({"type": "json_schema", "json_schema": {}}, "needs json_schema.schema"),
                       ({"type": "yaml"}, "'yaml' is not supported"),
                       ("json_object", "is not supported"),  # (a string, not an object)
                       ({"type": "json_schema", "json_schema": {"schema": deep}},
                        "nested deeper than 16"),
                       ({"type": "json_schema", "json_schema": {"schema": {
                           "type": "object", "properties": {"a": {"enum": [{"x": 1}]}}}}},
                        "enum must be a non-empty list of strings")):
        status, out = _post_json(base, {"messages": [{"role": "user", "content": "hi"}],
                                        "response_format": fmt})
        assert status == 400 and out["error"]["param"] == "response_format", out
        assert words in out["error"]["message"], out
