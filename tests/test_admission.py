"""The one admission policy (net/admission.py) every listener uses, on its own."""

from __future__ import annotations

import pytest

from edgelite.net.admission import Admission, AdmissionLimits

pytestmark = pytest.mark.unit


def test_strangers_have_a_budget_within_the_whole_and_one_address_cannot_take_either() -> None:
    a = Admission(AdmissionLimits(total=6, per_address=4, strangers=3, strangers_per_address=2))
    assert a.arrive("x") is None and a.arrive("x") is None
    refused = a.arrive("x")  # (x's strangers' share)
    assert refused is not None and refused.budget == "strangers" and "from x" in refused.why
    assert a.arrive("y") is None
    assert a.arrive("z").budget == "strangers"  # type: ignore[union-attr]  (all strangers' budget)
    for host in ("x", "x", "y"):
        a.authenticated(host)
    assert a.strangers == 0 and a.connections == 3
    assert a.arrive("x") is None and a.arrive("x") is None  # (x: 4 open, its share)
    a.authenticated("x")
    a.authenticated("x")
    refused = a.arrive("x")
    assert refused is not None and refused.budget == "connections" and "4 of them from x" in refused.why
    assert a.arrive("z") is None  # 6 open: the whole budget
    assert a.arrive("w").budget == "connections"  # type: ignore[union-attr]
    assert dict(a.refused) == {"strangers": 2, "connections": 2}


def test_leaving_gives_the_room_back_to_the_right_budget() -> None:
    a = Admission(AdmissionLimits(total=2, per_address=2, strangers=1, strangers_per_address=1))
    assert a.arrive("x") is None
    a.leave("x", authenticated=False)  # (a failed handshake)
    assert a.connections == 0 and a.strangers == 0 and not a.open and not a.unknown
    assert a.arrive("x") is None
    a.authenticated("x")
    assert a.arrive("y") is None
    a.leave("x", authenticated=True)
    assert a.connections == 1 and a.strangers == 1
    a.leave("y", authenticated=False)
    assert a.connections == 0 and a.strangers == 0

