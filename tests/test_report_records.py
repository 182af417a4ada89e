"""Reports that cross a JSON edge (Ray's routing stats, Redis, ``/status``) are read back as typed records: a
field of the wrong type is refused with a log line naming the sender, never passed on to fail later."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kvmesh.core.messages import (
    ClusterStatus,
    EngineStats,
    IndexSize,
    LoadReport,
    MalformedReport,
    RedisHealth,
    ReplicaStatus,
    RoutingCount,
)


def test_a_load_report_survives_its_dict_and_a_malformed_one_is_refused_with_a_log_line(caplog):
    report = LoadReport(index_id="r1", num_running=2, kv_free_blocks=10, prefill_tok_s=1800, node="198.18.0.2")
    assert LoadReport.from_dict(report.as_dict()) == report
    assert LoadReport.from_dict({**report.as_dict(), "from_a_newer_replica": 1}) == report  # unknown keys dropped
    assert LoadReport.from_dict({}) is None and LoadReport.from_dict(None) is None  # not reported yet
    with caplog.at_level(logging.WARNING):
        bad = LoadReport.from_dict({**report.as_dict(), "num_running": "2"}, sender="worker http://w:8000")
        flag = LoadReport.from_dict({**report.as_dict(), "kv_usage": True}, sender="replica r1")
    assert bad is None and flag is None
    assert "worker http://w:8000" in caplog.text and "LoadReport.num_running" in caplog.text
    assert "LoadReport.kv_usage" in caplog.text  # a bool is not a number here


def test_every_report_is_derived_from_one_engine_stats_record():
    stats = EngineStats(
        num_running=3,
        num_waiting=1,
        kv_total_blocks=64,
        num_free_blocks=40,
        waiting_blocks=4,
        kv_free_blocks=36,
        prompt_tokens=200,
        cached_prompt_tokens=50,
        cached_prompt_tokens_host=10,
        num_preemptions=5,
        prefill_busy=0.25,
    )
    report = LoadReport.of(stats, index_id="r", node="n")
    assert (report.num_running, report.kv_free_blocks, report.prefill_busy, report.node) == (3, 36, 0.25, "n")
    status = ReplicaStatus.of(stats, pid=7)
    assert {f.name: getattr(status, f.name) for f in dataclasses.fields(EngineStats)} == dataclasses.asdict(stats)
    assert (status.prefix_hit_rate, status.host_hit_rate) == (0.25, 0.05)
    pressure = stats.kv_pressure(preemptions_seen=2)
    assert (pressure.kv_used_blocks, pressure.kv_waiting_blocks, pressure.preemptions) == (24, 4, 3)


def test_a_cluster_status_round_trips_and_a_partial_one_names_what_is_missing():
    status = ClusterStatus(
        model="m",
        policy="kv_aware",
        replicas={"r": ReplicaStatus(num_running=1, prefill_busy=0.5)},
        decisions=[RoutingCount(policy="kv_aware", reason="hit", count=4)],
        index=IndexSize(entries=12),
        live_replicas=1,
        redis=RedisHealth(ok=True, ping_ms=0.3, used_memory="1M"),
    )
    assert ClusterStatus.from_dict(status.as_dict()) == status
    assert status.as_dict()["index"] == {"entries": 12}  # the JSON shape scripts read
    with pytest.raises(MalformedReport, match="missing index"):
        ClusterStatus.from_dict({k: v for k, v in status.as_dict().items() if k != "index"})
    with pytest.raises(MalformedReport, match=r"RoutingCount\.count"):
        ClusterStatus.from_dict({**status.as_dict(), "decisions": [{"policy": "p", "reason": "r", "count": "4"}]})
    with pytest.raises(MalformedReport, match=r"ReplicaStatus\.num_running"):
        ClusterStatus.from_dict({**status.as_dict(), "replicas": {"r": {"num_running": [1]}}})
