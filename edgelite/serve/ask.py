"""What a client asks the gateway for, the same whichever front door it came through.

Each door turns its own format into an `Ask` (`serve/native.py`: a GenerateRequest frame;
`serve/http.py`: an OpenAI JSON body) and checks only what its format cannot say (JSON types,
the door's own fields). Every rule on the values lives here, and `Gateway.submit` applies it
once: a request refused through one door is refused through the other with the same words.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from edgelite.config import GatewayConfig, GenerationConfig
from edgelite.errors import EdgeliteError, ProtocolError
from edgelite.reply.jsonschema import schema_size
from edgelite.reply.loop import RESPONSE_FORMATS, parse_schema
from edgelite.reply.tools import call_schema, check_choice, parse_tools

ROLES = ("system", "user", "assistant", "tool")


class AskError(ProtocolError):
    """A request out of bounds; `param` names the field (OpenAI's error JSON carries it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Ask:
    """One request: chat `messages` (rendered with the model's chat template) or raw `text`
    (continued as it is), and its sampling settings (None: the gateway's defaults)."""

    # [{"role", "content"}]; an assistant's earlier tool calls: "tool_calls", JSON text of
    # [{"name", "arguments"}] (reply/tools.py); a call's result: role "tool"
    messages: list[dict[str, str]] | None = None
    text: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    speculate: str | None = None  # off | lookup (GenerationConfig.speculate)
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: int | None = None  # alternatives per token with each token's log probability
    response_format: str | None = None  # text | json_object | json_schema (GenerationConfig's)
    json_schema: str | None = None  # with json_schema: the schema, as JSON text
    tools: str | None = None  # OpenAI's tools list, as JSON text (GenerationConfig.tools)
    tool_choice: str | None = None  # auto | none | required | a tool's name
    embedding: bool = False  # the text's embedding (reply/embed.py), not a reply


def check(ask: Ask, cfg: GatewayConfig) -> None:
    """Raise AskError naming the first rule `ask` breaks."""
    if (ask.messages is None) == (ask.text is None):
        raise AskError("a request needs messages [{role, content}] or a prompt, not both",
                       "messages")
    if ask.messages is not None:
        if not ask.messages:
            raise AskError("messages must be a non-empty list of {role, content}", "messages")
        for i, msg in enumerate(ask.messages):
            if msg["role"] not in ROLES:
                raise AskError(f"messages[{i}].role must be one of {', '.join(ROLES)} "
                               f"(got {msg['role'][:32]!r})", "messages")
            if "tool_calls" in msg:
                _check_calls(msg, i)
    # every text the request carries counts, a character beyond the BMP as the 4 a tokenizer
    # may make of its bytes (UTF-16 encodes it as a pair, and refuses a lone surrogate)
    chars = 0
    for text in _texts(ask):
        try:
            units = len(text.encode("utf-16-le")) // 2
        except UnicodeEncodeError:
            raise AskError("the request holds malformed Unicode (a lone surrogate)",
                           "messages" if ask.messages is not None else "prompt") from None
        chars += len(text) + 3 * (units - len(text))
    if chars > cfg.max_prompt_chars:
        raise AskError(f"the prompt has {chars} characters; this server takes at most "
                       f"{cfg.max_prompt_chars} (max_prompt_chars)",
                       "messages" if ask.messages is not None else "prompt")
    _within(ask.max_tokens, "max_tokens", 1, cfg.max_tokens_limit)
    _within(ask.temperature, "temperature", 0.0, cfg.max_temperature)
    _within(ask.top_p, "top_p", 0.0, 1.0)
    _within(ask.seed, "seed", 0, 2**63 - 1)
    _within(ask.top_k, "top_k", 0, 2**31 - 1)
    _within(ask.min_p, "min_p", 0.0, 1.0)
    _within(ask.presence_penalty, "presence_penalty", -2.0, 2.0)
    _within(ask.frequency_penalty, "frequency_penalty", -2.0, 2.0)
    _within(ask.repetition_penalty, "repetition_penalty", 0.01, 10.0)
    _within(ask.logprobs, "top_logprobs", 0, cfg.max_top_logprobs)
    if ask.response_format not in (None, *RESPONSE_FORMATS):
        raise AskError(f"response_format must be text, json_object or json_schema (got "
                       f"{ask.response_format[:16]!r})", "response_format")
    if ask.response_format == "json_schema":
        if len(ask.json_schema or "") > cfg.max_schema_chars:
            raise AskError(f"the JSON schema has more than {cfg.max_schema_chars} characters",
                           "response_format")
        try:
            schema = parse_schema(ask.json_schema or "")
        except EdgeliteError as exc:
            raise AskError(f"response_format json_schema: {exc}", "response_format") from None
        _within_size(schema_size(schema), cfg, "response_format")
    _check_tools(ask, cfg)
    if ask.embedding and ask.text is None:
        raise AskError("an embedding is of a text (input), not of chat messages", "input")
    if ask.speculate not in (None, "off", "lookup"):
        raise AskError(f"speculate must be off or lookup (got {ask.speculate[:16]!r}; a gateway "
                       f"drafts by prompt lookup only)", "speculate")
    if (len(ask.stop) > cfg.max_stops
            or not all(0 < len(s) <= cfg.max_stop_chars for s in ask.stop)):
        raise AskError(f"stop must be a string or a list of up to {cfg.max_stops} non-empty "
                       f"strings of at most {cfg.max_stop_chars} characters", "stop")


def _texts(ask: Ask) -> list[str]:
    """Every text a request carries: its messages (and their earlier tool calls) or its prompt,
    its tools, its schema."""
    texts = [v for msg in ask.messages or () for k, v in msg.items() if k != "role" and isinstance(v, str)]
    return [*texts, *(t for t in (ask.text, ask.tools, ask.json_schema) if t)]


def _check_calls(msg: dict[str, str], i: int) -> None:
    """An earlier reply's tool calls (JSON text of [{"name", "arguments"}])."""
    where = f"messages[{i}].tool_calls"
    if msg["role"] != "assistant":
        raise AskError(f"{where}: only the assistant's messages carry tool calls", "messages")
    try:
        calls = json.loads(msg["tool_calls"])
    except (ValueError, RecursionError):
        calls = None
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str)
            and isinstance(c.get("arguments"), dict) for c in calls):
        raise AskError(f"{where} must be a list of {{name, arguments}} (arguments: a JSON "
                       f"object)", "messages")


def _check_tools(ask: Ask, cfg: GatewayConfig) -> None:
    if not ask.tools:
        if ask.tool_choice not in (None, "auto", "none"):
            raise AskError("tool_choice needs tools", "tool_choice")
        return
    if ask.messages is None:
        raise AskError("tools go with chat messages, not a raw prompt", "tools")
    if ask.response_format not in (None, "text"):
        raise AskError("tools and a response_format other than text do not go together (a "
                       "tool's arguments follow its own schema)", "response_format")
    if len(ask.tools) > cfg.max_schema_chars:
        raise AskError(f"tools take more than {cfg.max_schema_chars} characters as JSON", "tools")
    try:
        tools = parse_tools(ask.tools)
    except EdgeliteError as exc:
        raise AskError(str(exc), "tools") from None
    _within_size(schema_size(call_schema(tools, "auto")), cfg, "tools")
    try:
        check_choice(ask.tool_choice or "auto", tools)
    except EdgeliteError as exc:
        raise AskError(str(exc), "tool_choice") from None


def _within_size(size: int, cfg: GatewayConfig, param: str) -> None:
    if size > cfg.max_schema_values:
        raise AskError(f"the schema has {size} enum values, properties and anyOf branches; this "
                       f"server takes at most {cfg.max_schema_values} (max_schema_values)", param)


def _within(value: float | None, name: str, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise AskError(f"{name} must be within {lo:g}..{hi:g} (got {value:g})", name)


def generation(ask: Ask, defaults: GenerationConfig) -> GenerationConfig:
    """The reply loop's settings: the request's, else the gateway's defaults."""
    given = {k: v for k, v in (("max_tokens", ask.max_tokens), ("temperature", ask.temperature),
                               ("top_p", ask.top_p), ("seed", ask.seed),
                               ("speculate", ask.speculate), ("top_k", ask.top_k),
                               ("min_p", ask.min_p), ("presence_penalty", ask.presence_penalty),
                               ("frequency_penalty", ask.frequency_penalty),
                               ("repetition_penalty", ask.repetition_penalty),
                               ("logprobs", ask.logprobs),
                               ("response_format", ask.response_format),
                               ("json_schema", ask.json_schema), ("tools", ask.tools),
                               ("tool_choice", ask.tool_choice)) if v is not None}
    return dataclasses.replace(defaults, **given, stop=ask.stop or defaults.stop)
