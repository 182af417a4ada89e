import subprocess
import sys

import pytest


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cluster.launch.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_generate_streams_text_and_reports_tokens(tiny_llama_dir):
    res = run_cli("generate", "Tell me a story", "--model", str(tiny_llama_dir), "--max-tokens", "12", "--raw")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "[12 tokens, finish=length" in res.stderr


def test_generate_rejects_bad_input_with_a_clear_error(tiny_llama_dir):
    res = run_cli("generate", "x", "--model", str(tiny_llama_dir), "--temperature", "-1")
    assert res.returncode == 2 and "temperature" in res.stderr
    res = run_cli("generate", "x", "--model", "/nonexistent/model")
    assert res.returncode == 2 and "error:" in res.stderr


def test_engine_and_router_refuse_a_port_they_cannot_listen_on_before_saying_ready():
    """A port in use or out of range is a command-line error within seconds (before the model loads or a
    worker is contacted), never a "ready" line followed by uvicorn's failure or a server that never listens."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = str(taken.getsockname()[1])
    worker = ["--worker", "http://127.0.0.1:9"]
    try:
        for args in (["engine", "--port", port], ["router", *worker, "--port", port], ["engine", "--port", "80000"]):
            res = run_cli(*args, timeout=60)
            assert res.returncode == 2, (args, res.stdout, res.stderr)
            assert "ready" not in res.stdout
            assert "cannot listen" in res.stderr or "out of range" in res.stderr
    finally:
        taken.close()


def test_router_refuses_bad_settings_before_serving():
    from kvmesh.cluster.launch.embedded_redis import free_port

    worker = ["--worker", "http://127.0.0.1:9", "--port", str(free_port())]
    res = run_cli("router", *worker, "--worker", "http://127.0.0.1:9/", timeout=60)
    assert res.returncode == 2 and "named twice" in res.stderr
    for flag, message in (("--block-size", "block_size"), ("--max-model-len", "max_model_len")):
        res = run_cli("router", *worker, flag, "0", timeout=60)
        assert res.returncode == 2 and f"{message} must be at least 1" in res.stderr, res.stderr


def test_router_and_serve_refuse_bad_policy_settings_before_serving():
    from kvmesh.cluster.launch.embedded_redis import free_port

    router = ["router", "--worker", "http://127.0.0.1:9", "--port", str(free_port())]
    serve = ["serve", "--port", str(free_port())]
    for command in (router, serve):
        res = run_cli(*command, "--policy-kwargs", '{"sesion_balance": 2}', timeout=60)
        assert res.returncode == 2 and "sesion_balance" in res.stderr and "session_balance" in res.stderr, res.stderr
        res = run_cli(*command, "--policy-kwargs", "[2]", timeout=60)
        assert res.returncode == 2 and "must be a JSON object" in res.stderr, res.stderr
    res = run_cli(*router, "--policy-kwargs", '{"session_balance": 0.5}', timeout=60)
    assert res.returncode == 2 and "session_balance must be" in res.stderr, res.stderr


def test_policy_settings_reach_the_policy():
    from kvmesh.cluster.launch.cli import _policy_kwargs, build_parser
    from kvmesh.cluster.launch.config import build_config
    from kvmesh.cluster.workers.router_server import LocalRouter

    args = build_parser().parse_args(["router", "--worker", "http://w:8000", "--policy-kwargs", '{"wait_cap": 3}'])
    assert LocalRouter([], args.policy, _policy_kwargs(args)).policy.wait_cap == 3
    assert build_config(None, {"policy_kwargs": {"wait_cap": 3}}).policy_kwargs == {"wait_cap": 3}


def test_engine_refuses_a_thread_count_or_context_below_one():
    from kvmesh.cluster.launch.embedded_redis import free_port

    for flag, name in (("--threads", "torch_threads"), ("--max-model-len", "max_model_len")):
        res = run_cli("engine", "--port", str(free_port()), flag, "-2", timeout=60)
        assert res.returncode == 2 and f"{name} must be positive" in res.stderr, res.stderr[-500:]


def test_kvmesh_serve_configures_before_ray_is_imported():
    """A local Ray binds loopback only if its environment is set before Ray is first imported
    (``launcher._start_ray``): building the configuration must not import Ray (a ``RoutingSettings``
    import once did, and every Ray port listened on all interfaces)."""
    code = (
        "import sys\n"
        "from kvmesh.cluster.launch.config import build_config\n"
        "import kvmesh.cluster.launch.cli, kvmesh.cluster.launch.launcher\n"
        "build_config(overrides={'workers': [{'url': 'http://h:1'}]}).routing()\n"
        "print('ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_prefill_replicas_must_leave_a_replica_that_decodes():
    from kvmesh.cluster.launch.cli import build_parser
    from kvmesh.cluster.launch.config import build_config

    assert build_config(None, {"replicas": 3, "prefill_replicas": 1}).prefill_replicas == 1
    for replicas, prefill in ((2, 2), (1, 1), (3, -1)):
        with pytest.raises(ValueError, match="prefill_replicas"):
            build_config(None, {"replicas": replicas, "prefill_replicas": prefill})
    args = build_parser().parse_args(["serve", "--replicas", "3", "--prefill-replicas", "1"])
    assert args.prefill_replicas == 1 and args.keep_kv is None  # unset: the config's (default True)
    assert build_parser().parse_args(["serve", "--no-keep-kv"]).keep_kv is False
    assert build_config(None, {}).keep_kv and not build_config(None, {"keep_kv": False}).keep_kv
