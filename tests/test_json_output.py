"""`response_format` json_object and json_schema: the prefix automaton agrees with
`json.loads` on generated objects and their mutations; every prefix of an object a schema
accepts fits it, and whole objects it refuses do not; schemas outside the subset are refused
naming what (the replies over HTTP: test_http.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgelite.errors import EdgeliteError
from edgelite.reply.jsonprefix import JsonConstraint, JsonPrefix, incomplete
from edgelite.reply.jsonschema import check_reply_schema, fits, pending

pytestmark = pytest.mark.unit

VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12)
OBJECTS = st.dictionaries(st.text(max_size=5), VALUES, max_size=4)


@settings(max_examples=300, deadline=None)
@given(OBJECTS, st.integers(0, 10**6), st.sampled_from(list('{}[]",:0-e.tfn\\ x1\u00e9')),
       st.booleans())
def test_the_prefix_automaton_agrees_with_json_loads(obj, where, ch, indent) -> None:
    text = json.dumps(obj, indent=1 if indent else None, ensure_ascii=where % 2 == 0)
    state = JsonPrefix()
    for i, c in enumerate(text):  # every prefix of an object is taken, one character at a time
        assert state.feed(c), (text, i)
    assert state.done
    i = where % len(text)
    mutated = text[:i] + ch + text[i + 1:]
    probe = JsonPrefix()
    took = probe.feed(mutated)
    try:
        valid = isinstance(json.loads(mutated), dict)
    except ValueError:
        valid = False
    assert (took and probe.done) == valid, mutated
    if not took:  # a refused text leaves the state as it was
        assert probe == JsonPrefix()


SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "mood": {"enum": ["happy", "sad", None]},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "home": {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]},
                         "ok": {"type": ["boolean", "null"]}},
          "required": ["name", "age"]}
CONFORMING = st.fixed_dictionaries(
    {"name": st.text(max_size=6), "age": st.integers(-10**6, 10**6)},
    optional={"mood": st.sampled_from(["happy", "sad", None]),
              "tags": st.lists(st.text(max_size=4), max_size=3),
              "home": st.fixed_dictionaries({"city": st.text(max_size=5)}),
              "ok": st.sampled_from([True, False, None])})


@settings(max_examples=200, deadline=None)
@given(CONFORMING, st.booleans())
def test_every_prefix_of_a_conforming_object_fits_its_schema(obj, indent) -> None:
    text = json.dumps(obj, indent=1 if indent else None, ensure_ascii=False)
    for i in range(len(text) + 1):
        assert fits(SCHEMA, text[:i]), text[:i]


@pytest.mark.parametrize("bad", [
    {"name": "a"},  # a required key missing
    {"name": "a", "age": 1.5},  # a number where an integer goes
    {"name": "a", "age": 1, "mood": "angry"},  # outside the enum
    {"name": "a", "age": 1, "extra": 1},  # a key outside properties
    {"name": 3, "age": 1},  # a number where a string goes
    {"name": "a", "age": 1, "tags": ["x", 2]},  # an item of another type
    {"name": "a", "age": 1, "home": {}},  # a nested required key missing
    {"name": "a", "age": 1, "ok": "yes"}])
def test_a_whole_object_outside_the_schema_does_not_fit(bad) -> None:
    assert not fits(SCHEMA, json.dumps(bad))


def test_schemas_outside_the_subset_are_refused_naming_what() -> None:
    check_reply_schema(SCHEMA)
    for schema, words in (({"type": "object", "properties": {"a": {"type": "string",
                                                                  "pattern": "x"}}},
                           "keyword 'pattern' is not supported"),
                          ({"type": "array"}, "its type must be object"),
                          ({"type": "object", "required": ["b"]}, "required must list keys"),
                          ({"type": "object", "additionalProperties": True},
                           "additionalProperties must be false"),
                          ({"type": "object", "properties": {"a": {"type": "date"}}},
                           "type 'date' is not one of"),
                          ({"type": "object", "properties": {"a": {"enum": []}}},
                           "enum must be a non-empty list")):
        with pytest.raises(EdgeliteError, match=words):
            check_reply_schema(schema)


@pytest.mark.parametrize(("data", "tail"), [
    (b"", b""), (b"abc", b""), (b"\xc3", b"\xc3"), (b"caf\xc3", b"\xc3"), (b"\xe4\xb8", b"\xe4\xb8"),
    (b"\xe4\xb8\xad", b""), (b"\xf0\x9f\x98", b"\xf0\x9f\x98"), (b"\xef\xbf\xbd", b""),
    (b"\xa9", None), (b"a\xa9", None), (b"\xc3\xc3", b"\xc3"), (b"\xc0", None), (b"\xf5", None),
    (b"\xe0\x80", None), (b"\xed\xa0", None), (b"\xf0\x80", None), (b"\xf4\x90", None),
    (b"\xe4\xb8\xad\xad", None), (b"\x80\x80\x80\x80", None),
])
def test_the_bytes_a_character_still_coming_began_with(data: bytes, tail: bytes | None) -> None:
    assert incomplete(data) == tail


def test_a_character_still_coming_fits_only_the_values_its_bytes_begin() -> None:
    schema = check_reply_schema({"type": "object", "properties": {"x": {"enum": ["中国", "日本", "ok"]}}})
    assert fits(schema, '{"x":"' + pending(b"\xe4"))  # (中: e4 b8 ad)
    assert fits(schema, '{"x":"' + pending(b"\xe6\x97"))  # (日: e6 97 a5)
    assert not fits(schema, '{"x":"' + pending(b"\xe5"))  # (国 comes second)
    assert fits(schema, '{"x":"中' + pending(b"\xe5\x9b"))
    assert not fits(schema, '{"x":"o' + pending(b""))
    assert fits(schema, '{"x":"' + pending(b""))  # (bytes not known: any non-ASCII character)


def test_a_token_choice_past_its_time_ends_the_reply_naming_it() -> None:
    vocab = ["{", *("x" * (1 + i % 7) for i in range(20000))]  # (after "{", none of the rest fits)
    constraint = JsonConstraint(lambda ids: "".join(vocab[i] for i in ids), frozenset({-1}), max_tries=4,
                                limit_s=0.0)
    logits = np.zeros(len(vocab), np.float32)
    logits[0] = 1.0
    assert constraint.choose(logits, lambda x: int(np.argmax(x))) == 0
    with pytest.raises(EdgeliteError, match="the JSON constraint took over 0 s choosing one token"):
        constraint.choose(logits, lambda x: int(np.argmax(x)))
    patient = JsonConstraint(lambda ids: "".join(vocab[i] for i in ids), frozenset({-1}), max_tries=4)
    patient.choose(logits, lambda x: int(np.argmax(x)))
    with pytest.raises(EdgeliteError, match="no token of the model's vocabulary continues"):
        patient.choose(logits, lambda x: int(np.argmax(x)))  # (the whole scan, then the plain refusal)
