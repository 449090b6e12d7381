"""Tool calls (OpenAI's `tools` and `tool_choice`): the tools a reply may call, how the prompt
shows them to the model, and how the reply's tokens are chosen while it is, or may become, a
call.

A call is one JSON object, `{"name": ..., "arguments": {...}}`, whose arguments follow the
tool's `parameters` (reply/jsonschema.py's subset): once a reply is a call its tokens are
chosen as for `response_format: json_schema` (reply/jsonprefix.py's JsonConstraint), and it
ends when the object does, with finish "tool_calls". One call per reply.

How the model sees the tools depends on its chat template (`style_of`):
- a template that takes `tools` renders them itself (Qwen 2.5, Llama 3.1+, Hermes...); if it
  writes calls between `<tool_call>` tags, a call opens with that tag;
- any other template (SmolLM2, Gemma 3) gets them in a system message (`tool_prompt`) that asks
  for the bare JSON object.

`tool_choice`: "auto" (the default): the reply is a call if it opens with one (the tag, or `{`
for the bare object; a tagged model's bare `{"name"` too: small models of those families, such
as Qwen2.5-Coder-0.5B, often leave the tags out), else text; "required" or a tool's name: the
reply is a call from its first token (a tag is put at the end of the prompt); "none": the reply
is text, and the prompt shows no tools. A conversation's earlier calls and their results (assistant messages
with `tool_calls`, messages of role "tool") are rendered as the model's own format writes
them (`history`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgelite.errors import EdgeliteError
from edgelite.reply.jsonprefix import Budget, JsonConstraint, draw_allowed, likeliest_first
from edgelite.reply.jsonschema import check_schema

CHOICES = ("auto", "none", "required")  # or a tool's name
MAX_TOOLS = 64
MAX_NAME = 64
TAG_OPEN = "<tool_call>"  # (the call ends with its JSON: the closing tag is never written)
BARE_NAMED = '{"name"'  # how a tagged model's call opens when it leaves the tag out


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of type object (reply/jsonschema.py's subset)

    def openai(self) -> dict[str, Any]:
        """OpenAI's shape, as chat templates take it."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class Style:
    """How a model writes a call: `opening` before the JSON ("": the bare object) and
    whether its template renders the tools itself (`native`)."""

    native: bool
    opening: str = ""


def style_of(template: str | None) -> Style:
    """The tool style of a chat template (its Jinja source; None: no template)."""
    if not template or "tools" not in template:
        return Style(native=False)
    if TAG_OPEN in template:
        return Style(native=True, opening=TAG_OPEN + "\n")
    return Style(native=True)


def parse_tools(text: str) -> tuple[Tool, ...]:
    """The tools of a request, from OpenAI's `tools` list as JSON text; EdgeliteError names
    the first thing wrong."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise EdgeliteError(f"tools is not JSON: {exc}") from None
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_TOOLS:
        raise EdgeliteError(f"tools must be a list of 1 to {MAX_TOOLS} tools")
    tools: list[Tool] = []
    for i, entry in enumerate(raw):
        fn = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise EdgeliteError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                f"{{name, description, parameters}}}}")
        name, desc = fn.get("name"), fn.get("description", "")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME \
                or not name.replace("_", "a").replace("-", "a").isalnum():
            raise EdgeliteError(f"tools[{i}].function.name must be 1 to {MAX_NAME} letters, "
                                f"digits, _ or -")
        if not isinstance(desc, str):
            raise EdgeliteError(f"tools[{i}].function.description must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        try:
            check_schema(params, f"tools[{i}].function.parameters")
        except EdgeliteError as exc:
            raise EdgeliteError(str(exc)) from None
        if params.get("type", "object") != "object":
            raise EdgeliteError(f"tools[{i}].function.parameters must be of type object")
        if any(t.name == name for t in tools):
            raise EdgeliteError(f"tools: {name!r} is named twice")
        tools.append(Tool(name, desc, params))
    return tuple(tools)


def check_choice(choice: str, tools: Sequence[Tool]) -> None:
    if choice not in CHOICES and not any(t.name == choice for t in tools):
        raise EdgeliteError(f"tool_choice must be auto, none, required or the name of one of "
                            f"the tools (got {choice[:MAX_NAME]!r})")


def call_schema(tools: Sequence[Tool], choice: str) -> dict[str, Any]:
    """The schema a call's JSON follows: any of the tools (or the one named by `choice`),
    with its name and its arguments."""
    chosen = [t for t in tools if choice in CHOICES or t.name == choice]
    return {"anyOf": [{"type": "object", "required": ["name", "arguments"], "properties": {
        "name": {"enum": [t.name]}, "arguments": t.parameters}} for t in chosen]}


def forced(choice: str) -> bool:
    """The reply is a call from its first token."""
    return choice not in ("auto", "none")


def tool_prompt(tools: Sequence[Tool], choice: str) -> str:
    """The system message that shows the tools to a model whose template does not."""
    listed = "\n".join(json.dumps(t.openai()["function"], ensure_ascii=False) for t in tools)
    how = ('{"name": <the tool\'s name>, "arguments": <an object of its arguments>}')
    if forced(choice):
        ask = f"Reply with only a JSON object that calls one of them: {how}."
    else:
        ask = (f"To call one, reply with only a JSON object: {how}. Otherwise answer the "
               f"user normally.")
    return f"You can call these tools:\n{listed}\n{ask}"


def history(messages: list[dict[str, Any]], style: Style,
            results: str = "system") -> list[dict[str, Any]]:
    """A conversation's messages as the template takes them: earlier calls (an assistant
    message's `tool_calls`, JSON text of [{name, arguments}]) in the model's own format, and
    tool results as role "tool" (a template that renders tools knows it) or as a message of
    role `results` ("system"; "user" for templates that take no system message there) saying
    what the tool returned, joined to the message before when it has that role (some
    templates insist on turns). Other messages go as they are."""
    out: list[dict[str, Any]] = []
    for msg in messages:
        role, content = msg["role"], msg.get("content") or ""
        calls = msg.get("tool_calls")
        if role == "assistant" and calls:
            parsed = json.loads(calls)
            if style.native:
                out.append({"role": "assistant", "content": content, "tool_calls": [
                    {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in parsed]})
                continue
            content = "\n".join(filter(None, [content, *(json.dumps(
                {"name": c["name"], "arguments": c["arguments"]}, ensure_ascii=False)
                for c in parsed)]))
        elif role == "tool" and not style.native:
            role, content = results, f"The tool returned: {content}"
            if out and out[-1]["role"] == role and "tool_calls" not in out[-1]:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + content}
                continue  # (several results in a row: one message)
        out.append({"role": role, "content": content})
    return out


def with_tools(messages: list[dict[str, Any]], tools: Sequence[Tool], choice: str,
               style: Style) -> list[dict[str, Any]]:
    """The messages of a model whose template does not render tools, with the tools shown in
    the system message (`tool_prompt`; joined to the conversation's own system message)."""
    if style.native or not tools or choice == "none":
        return messages
    text = tool_prompt(tools, choice)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def parse_call(text: str) -> dict[str, Any]:
    """{"name", "arguments"} of a call's complete JSON text (its schema held it so)."""
    obj = json.loads(text)
    return {"name": obj["name"], "arguments": obj["arguments"]}


@dataclass
class CallChooser:
    """Chooses the tokens of a reply that is, or may become, a tool call (see the module's
    doc). `state`: "open" (nothing but the start of a call's opening so far), "call" (the
    JSON constraint chooses), "text" (a plain reply: no constraint)."""

    decode: Callable[[list[int]], str]
    eos: frozenset[int]
    tools: tuple[Tool, ...]
    choice: str
    style: Style
    max_tries: int = 64
    token_bytes: Callable[[int], bytes] | None = None  # Tokenizer.token_bytes (JsonConstraint)
    limit_s: float = math.inf  # the longest one token's choice may take (JsonConstraint)
    ids: list[int] = field(default_factory=list)
    json: JsonConstraint | None = None
    state: str = "open"

    def __post_init__(self) -> None:
        self.schema = call_schema(self.tools, self.choice)
        if forced(self.choice):  # (the prompt ends with the opening)
            self.json = JsonConstraint(self.decode, self.eos, self.max_tries, self.schema,
                                       token_bytes=self.token_bytes, limit_s=self.limit_s)
            self.state = "call"

    @property
    def openings(self) -> tuple[str, ...]:
        """The texts a call opens with (the JSON starts at the first `{` of a bare one)."""
        tag = self.style.opening.strip()
        return (tag, BARE_NAMED) if tag else ("{",)

    @property
    def done(self) -> bool:
        """The call's JSON is complete."""
        return self.json is not None and self.json.state.done

    @property
    def call_text(self) -> str:
        return self.json.text if self.json is not None else ""

    def choose(self, logits: np.ndarray, pick: Callable[[np.ndarray], int]) -> int:
        if self.state == "call":
            assert self.json is not None
            tok = self.json.choose(logits, pick)
        elif self.state == "text":
            tok = pick(logits)
        else:
            tok = self._open(logits, pick)
        self.ids.append(tok)
        return tok

    def _open(self, logits: np.ndarray, pick: Callable[[np.ndarray], int]) -> int:
        """While the reply may still open a call: the token `pick` takes, unless it opens a
        call whose JSON could not follow the schema (then masked, and another taken)."""
        if (drawn := draw_allowed(logits, pick, lambda t: True if self._judge(t) else None,
                                  self.max_tries)) is not None:
            return drawn[0]
        clock = Budget(self.limit_s, "the tool-call constraint")
        for tok in likeliest_first(logits):
            clock.check()
            if self._judge(tok):
                return tok
        raise EdgeliteError("no token of the model's vocabulary continues the reply here")

    def _judge(self, tok: int) -> bool:
        """Whether `tok` may come next; the state it leads to is taken."""
        if tok in self.eos:
            self.state = "text"
            return True
        ids = [*self.ids, tok]
        text = self.decode(ids)
        lead = text.lstrip()
        if any(o.startswith(lead.rstrip("\ufffd")) for o in self.openings):
            return True  # (still open)
        opening = next((o for o in self.openings if lead.startswith(o)), None)
        if opening is None:
            self.state = "text"
            return True
        start = len(text) - len(lead) + (0 if opening.startswith("{") else len(opening))
        constraint = JsonConstraint(self.decode, self.eos, self.max_tries, self.schema, ids, start,
                                    self.token_bytes, self.limit_s)
        if not constraint.started:
            return False
        self.json, self.state = constraint, "call"
        return True
