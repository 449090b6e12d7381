"""`response_format: json_object`: the prefix automaton agrees with `json.loads` on generated
objects and their mutations (the replies over HTTP: test_http.py)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from edgelite.engine.jsonprefix import JsonPrefix

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
