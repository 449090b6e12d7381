"""Names and digests from the wire or a file are matched whole."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_a_name_or_digest_ending_in_a_newline_is_not_plain() -> None:
    """(`$` matches before a final newline: every such pattern is matched whole.)"""
    from edgelite import manifest as mf
    from edgelite.errors import ManifestError, ProtocolError
    from edgelite.node.shelf import plain_name

    assert plain_name("smollm2", "model") == "smollm2"
    with pytest.raises(ProtocolError, match="not a plain name"):
        plain_name("smollm2\n", "model")
    with pytest.raises(ManifestError, match="sha256"):
        mf._sha("a" * 64 + "\n", "x.sha256")
