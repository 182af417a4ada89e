import redis

from kvmesh.cluster.embedded_redis import EmbeddedRedis


def test_starts_answers_and_stops_cleanly():
    server = EmbeddedRedis().start()
    proc = server.process
    client = redis.Redis.from_url(server.url)
    assert client.ping()
    assert client.config_get("save")["save"] == "" and client.config_get("appendonly")["appendonly"] == "no"
    client.close()
    server.stop()
    assert proc.poll() is not None  # the process is gone, not orphaned
    server.stop()  # idempotent


def test_password_is_required_when_set_and_never_on_the_command_line():
    import psutil

    with EmbeddedRedis(password="s3cret") as server:
        assert redis.Redis.from_url(server.url).ping()
        assert "s3cret" not in " ".join(psutil.Process(server.process.pid).cmdline())  # ps shows argv to everyone
        anon = redis.Redis(host="127.0.0.1", port=server.port)
        try:
            anon.ping()
            raise AssertionError("unauthenticated ping succeeded")
        except redis.AuthenticationError:
            pass
        except redis.ResponseError as exc:
            assert "NOAUTH" in str(exc)


def test_restart_keeps_the_port_and_loses_the_data():
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        port = server.port
        server.restart()
        assert server.port == port and client.get("k") is None
        client.close()
