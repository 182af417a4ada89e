import redis

from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis


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


def test_the_server_ends_with_the_process_that_started_it():
    """``kvmesh serve`` killed outright (SIGKILL, an OOM kill) leaves no redis-server behind."""
    import os
    import signal
    import subprocess
    import sys

    from tests.process_helpers import outlived

    code = "from kvmesh.cluster.launch.embedded_redis import EmbeddedRedis; import time\n"
    code += "s = EmbeddedRedis().start(); print(s.process.pid, flush=True); time.sleep(600)"
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        server = int(owner.stdout.readline())
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
    assert not outlived({server: "redis-server"}, 10), "redis-server outlived the process that started it"
