"""Reading an attempts or incidents hash has one home (``incidents.documents``), used
by the run history, the chaos campaign and the elastic tests."""

from __future__ import annotations

from trainguard.core import incidents as inc


def test_a_hash_reads_as_its_documents_by_field_without_the_counter() -> None:
    """Every document of the hash comes back under its field, bytes or text alike; the
    ``seq`` counter is no document, and one that does not load is left out and named
    to ``on_bad`` (nothing else is dropped)."""
    good = {"attempt": 1, "cause": "crash"}
    raw = {b"seq": b"3", b"1": inc.dumps(good).encode(), "2": inc.dumps({"attempt": 2}),
           b"3": b"{not json", "4": '{"version": 999}'}
    bad: list[str] = []
    docs = inc.documents(raw, lambda field, exc: bad.append(field))
    assert docs == {"1": {"version": inc.INCIDENT_VERSION, **good},
                    "2": {"version": inc.INCIDENT_VERSION, "attempt": 2}}
    assert bad == ["3", "4"]
    assert inc.documents(None) == {}
