"""An engine replica and the index Redis: one that cannot reach it fails its start naming the address and
its node; one that loses it later keeps serving and says so in the load report the ingress reads."""

from __future__ import annotations

import time

import pytest

import kvmesh.cluster.engines.engine_replica as engine_replica
from kvmesh.cluster.engines.engine_replica import EngineReplica, IndexUnreachable
from kvmesh.cluster.launch.embedded_redis import free_port
from kvmesh.core.engine_config import EngineConfig

ENGINE = {"num_kv_blocks": 64, "torch_threads": 1}


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), **ENGINE)


def test_a_replica_that_cannot_reach_the_index_fails_its_start_naming_it(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(engine_replica, "INDEX_CONNECT_TIMEOUT_S", 1.0)
    port = free_port()  # nothing listens there
    with pytest.raises(IndexUnreachable) as failed:
        EngineReplica(engine_config(tiny_llama_dir), redis_url=f"redis://:secret@127.0.0.1:{port}/0")
    message = str(failed.value)
    assert f"127.0.0.1:{port}" in message and "on node " in message
    assert "secret" not in message  # the password is never in a message


def test_a_replica_that_loses_the_index_keeps_serving_and_reports_it(tiny_llama_dir, own_redis):
    replica = EngineReplica(engine_config(tiny_llama_dir), redis_url=own_redis.url)
    try:
        report = replica.record_routing_stats()
        assert report["index_error"] is None and report["node"]
        assert replica.status().node == report["node"]
        own_redis.stop()
        deadline = time.monotonic() + 15
        while (error := replica.record_routing_stats()["index_error"]) is None:
            assert time.monotonic() < deadline, "the load report never said the index was lost"
            time.sleep(0.1)
        assert f"127.0.0.1:{own_redis.port}" in error
        own_redis.start()  # back on the same port: the replica resynchronises and the report clears
        deadline = time.monotonic() + 15
        while replica.record_routing_stats()["index_error"] is not None:
            assert time.monotonic() < deadline, "the load report kept the error after Redis returned"
            time.sleep(0.1)
    finally:
        replica.publisher.close()
        replica.publisher = None
