"""The dispatch record: counting semantics, JSON snapshot, text table."""

from __future__ import annotations

import json

from ladle.observe import dispatch


def test_counts_snapshot_and_table():
    dispatch.reset()
    dispatch.register("demo_op", "triton", "cuda only")
    assert dispatch.decide("demo_op", "T<=8", configured=True, ineligible_reason=None) is True
    assert dispatch.decide("demo_op", "T<=8", configured=False, ineligible_reason=None) is False
    assert dispatch.decide("demo_op", "T<=64", configured=True, ineligible_reason="device ['cpu']") is False
    dispatch.record("demo_op", "T<=64", configured=True, eligible=True, executed=False, reason="graph off")
    snap = json.loads(json.dumps(dispatch.snapshot()))
    op = snap["ops"]["demo_op"]
    assert op["rule"] == "cuda only" and op["path"] == "triton"
    assert op["buckets"]["T<=8"] == {"configured": 1, "eligible": 2, "executed": 1, "calls": 2}
    assert op["buckets"]["T<=64"] == {"configured": 2, "eligible": 1, "executed": 0, "calls": 2}
    assert op["fallback_reasons"] == {"device ['cpu']": 1, "graph off": 1}
    table = dispatch.format_table()
    assert "demo_op" in table and "T<=64" in table and "device ['cpu']" in table
    dispatch.reset()
    assert dispatch.snapshot()["ops"]["demo_op"]["buckets"] == {}


def test_tokens_bucket():
    assert [dispatch.tokens_bucket(n) for n in (0, 1, 2, 3, 64, 65)] == ["T<=1", "T<=1", "T<=2", "T<=4", "T<=64",
                                                                          "T<=128"]
