"""How a reply under tool_choice "auto" becomes a call (reply/tools.py's CallChooser), driven
through SmolLM2's real vocabulary by a model that writes a given text (its logits favour that
text's next token): a tagged model's call opens with its tag or, as Qwen2.5-Coder-0.5B often
writes it, with the bare `{"name"` object (issue 66); other JSON and plain text stay text."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgelite import manifest as mf
from edgelite.reply.tokenizer import Tokenizer
from edgelite.reply.tools import TAG_OPEN, CallChooser, Style, parse_call, parse_tools

pytestmark = pytest.mark.engine
TOOLS = parse_tools('[{"type": "function", "function": {"name": "weather", "parameters": {'
                    '"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]')
CALL = '{"name": "weather", "arguments": {"city": "Paris"}}'
TAGGED = Style(native=True, opening=TAG_OPEN + "\n")


def _write(tok: Tokenizer, vocab: int, text: str, style: Style) -> CallChooser:
    """The chooser after a model that writes `text` (then its end) has run through it."""
    target = [*tok.encode(text), 2]
    chooser = CallChooser(tok.decode, frozenset({2}), TOOLS, "auto", style,
                          token_bytes=tok.token_bytes)
    for k in range(len(target)):
        logits = np.zeros(vocab, np.float32)
        logits[target[k]] = 10.0
        if chooser.choose(logits, lambda x: int(np.argmax(x))) == 2 or chooser.done:
            break
    return chooser


@pytest.mark.parametrize("text,style", [(CALL, TAGGED), (TAG_OPEN + "\n" + CALL, TAGGED),
                                        (CALL, Style(False))],
                         ids=["tagged model, bare object", "tagged model, tag", "bare model"])
def test_a_call_is_taken_however_the_model_opens_it(smollm2, text: str, style: Style) -> None:
    m = mf.load(Path(smollm2[0]))
    tok = Tokenizer(m)
    chooser = _write(tok, m.vocab_size, text, style)
    assert chooser.state == "call" and chooser.done, tok.decode(chooser.ids)
    assert parse_call(chooser.call_text) == {"name": "weather", "arguments": {"city": "Paris"}}


@pytest.mark.parametrize("text", ['{"city": "Paris"}', "Paris is sunny today."])
def test_other_json_and_text_from_a_tagged_model_stay_text(smollm2, text: str) -> None:
    m = mf.load(Path(smollm2[0]))
    tok = Tokenizer(m)
    chooser = _write(tok, m.vocab_size, text, TAGGED)
    assert chooser.state == "text" and tok.decode(chooser.ids[:-1]) == text
