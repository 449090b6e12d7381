"""A json_schema enum of non-ASCII values (issue 62: one ended in HTTP 500 after two full
vocabulary scans) through SmolLM2's own byte-level vocabulary: a character split over tokens is
taken only where its bytes can begin a value the schema allows, so even a draw from noise
(random logits, greedy) ends in one of the values; a lone continuation byte, a U+FFFD token
and bytes of the wrong character are refused along the way."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgelite import manifest as mf
from edgelite.reply.jsonprefix import JsonConstraint
from edgelite.reply.jsonschema import check_reply_schema
from edgelite.reply.tokenizer import Tokenizer

pytestmark = pytest.mark.engine
ENUMS = (["café", "naïve"], ["日本", "中国"], ["ok", "😀x"], ["Ωmega", "naïve", "日本"])


@pytest.mark.parametrize("values", ENUMS, ids=lambda v: "|".join(v))
def test_replies_drawn_from_noise_end_in_one_of_the_non_ascii_values(smollm2, values: list[str]) -> None:
    m = mf.load(Path(smollm2[0]))
    tok = Tokenizer(m)
    assert tok.token_bytes is not None and tok.token_bytes(tok.encode("é")[0]) == "é".encode()
    schema = check_reply_schema({"type": "object", "properties": {"x": {"enum": values}}, "required": ["x"]})
    eos = frozenset({0, 2})
    for seed in range(8):
        rng = np.random.default_rng(seed)
        constraint = JsonConstraint(tok.decode, eos, 64, schema, token_bytes=tok.token_bytes)
        for _ in range(80):
            if constraint.choose(rng.standard_normal(m.vocab_size).astype(np.float32),
                                 lambda logits: int(np.argmax(logits))) in eos:
                break
        assert json.loads(tok.decode(constraint.ids))["x"] in values, (seed, constraint.text)
