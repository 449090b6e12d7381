"""Tokenizer and chat template for the client (stage nodes never need this module).

Uses the `tokenizers` package (tokenizer.json) and jinja2 with the settings transformers uses to
render chat templates, so prompts match transformers' apply_chat_template token for token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgelite.errors import EdgeliteError, MissingDependency, ModelFileError
from edgelite.manifest import Manifest
from edgelite.reply.tools import forced, history, parse_tools, style_of, with_tools


def _require() -> tuple[Any, Any]:
    try:
        import jinja2.sandbox
        import tokenizers
    except ImportError as exc:
        raise MissingDependency(f"the chat client needs {exc.name}: pip install 'edgelite[chat]'") \
            from exc
    return tokenizers, jinja2.sandbox


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte's character in a vocabulary's tokens."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {b: chr(b) for b in shown}, 0
    for b in range(256):
        if b not in out:
            out[b], extra = chr(256 + extra), extra + 1
    return out


class TemplateRefusal(ValueError):
    """A chat template's own raise_exception (e.g. roles that do not alternate)."""


def _raise(message: str) -> None:
    raise TemplateRefusal(message)


class Tokenizer:
    def __init__(self, manifest: Manifest) -> None:
        tokenizers, sandbox = _require()
        path: Path = manifest.root / manifest.tokenizer
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelFileError(f"{path}: cannot load tokenizer: {exc}") from exc
        self.special = manifest.special_tokens or {}
        self.tool_style = style_of(manifest.chat_template)  # how its template shows tools
        self.template = None
        if manifest.chat_template:
            env = sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            self.template = env.from_string(manifest.chat_template)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def text_prompt(self, text: str) -> list[int]:
        """A plain-text prompt (no chat template) as the model's own tokenizer makes it: with
        the tokens it adds itself, such as Gemma's and Llama's <bos>."""
        return list(self.tok.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def token_bytes(self) -> Callable[[int], bytes] | None:
        """A token's bytes as its text takes them (special tokens: none), for vocabularies of
        GPT-2's byte alphabet (SmolLM2, Qwen, Llama 3) or of SentencePiece pieces with byte
        fallback ("<0xC3>": Gemma, Mistral, Phi); None for any other. JSON constraints weigh
        candidate tokens by them (reply/jsonprefix.py). The whole table is made at first use."""
        if self.tok.token_to_id("\u0120") is not None:  # (GPT-2's space, "Ġ")
            back = {c: b for b, c in _byte_alphabet().items()}

            def piece(text: str) -> bytes:
                return bytes(back[c] for c in text if c in back)
        elif self.tok.token_to_id("<0x80>") is not None:
            def piece(text: str) -> bytes:
                if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                    return bytes([int(text[3:5], 16)])
                return text.replace("\u2581", " ").encode()
        else:
            return None
        added = self.tok.get_added_tokens_decoder()  # (their text as it is; special ones: none)
        table = [b"" if i in added and added[i].special else added[i].content.encode() if i in added
                 else piece(self.tok.id_to_token(i) or "") for i in range(self.tok.get_vocab_size())]
        return lambda tid: table[tid] if 0 <= tid < len(table) else b""

    def chat_prompt(self, messages: list[dict[str, str]], tools: str = "",
                    tool_choice: str = "auto") -> list[int]:
        """Token ids of the conversation rendered for the assistant's next reply; with
        `tools` (JSON text of OpenAI's list) shown as reply/tools.py says for this template."""
        style = self.tool_style
        shown = parse_tools(tools) if tools and tool_choice != "none" else ()
        turns = with_tools(history(messages, style), shown, tool_choice, style)
        if self.template is None:
            return self.encode("\n".join(m["content"] for m in turns))
        extra = {"tools": [t.openai() for t in shown]} if shown and style.native else {}
        try:
            text = self._render(turns, extra)
        except EdgeliteError:  # (e.g. no system message after a turn: results as the user's)
            if not any(m["role"] == "tool" for m in messages) or style.native:
                raise
            text = self._render(with_tools(history(messages, style, "user"), shown, tool_choice,
                                           style), extra)
        if shown and forced(tool_choice):
            text += style.opening  # (the reply goes on from a call's opening)
        return self.encode(text)

    def _render(self, turns: list[dict[str, Any]], extra: dict[str, Any]) -> str:
        """The template's text; EdgeliteError when it refuses the messages (its own words)."""
        assert self.template is not None
        try:
            return self.template.render(messages=turns, add_generation_prompt=True,
                                        bos_token=self.special.get("bos_token") or "",
                                        eos_token=self.special.get("eos_token") or "", **extra)
        except TemplateRefusal as exc:
            raise EdgeliteError(f"the model's chat template refused these messages: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - any error of a model's own template code
            raise EdgeliteError(f"the model's chat template failed on these messages: "
                                f"{type(exc).__name__}: {str(exc)[:200]}") from None


class StreamDecoder:
    """Turns a growing list of ids into text increments, holding back partial UTF-8."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.ids, self.sent = tok, [], 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new

    def flush(self) -> str:
        """The text not returned yet (an incomplete character at the end, as U+FFFD)."""
        text = self.tok.decode(self.ids)
        new, self.sent = text[self.sent:], len(text)
        return new
