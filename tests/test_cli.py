import subprocess
import sys


def run_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cluster.cli", *args], capture_output=True, text=True, timeout=timeout
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
