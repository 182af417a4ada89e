"""``kvmesh serve`` with two ingress replicas (each its own router): an adapter loaded at run time through one
is served through both, and once unloaded through one, neither serves it (the ingresses share run-time
adapters through the Redis the index lives in)."""

from __future__ import annotations

import time

import httpx
import pytest

from kvmesh.bench.harness.serve_process import ServeProcess
from tests.lora_helpers import ALL_MODULES, make_adapter, merged_greedy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_an_adapter_loaded_through_one_ingress_is_served_through_every_one(tiny_llama_dir, tmp_path):
    make_adapter(tiny_llama_dir, tmp_path / "extra", 8, ALL_MODULES, 3, scale=0.5)
    prompt = [300 + i for i in range(20)]
    expected = merged_greedy(tiny_llama_dir, tmp_path / "extra", [prompt], 6)[0]
    args = ["--model", str(tiny_llama_dir), "--replicas", "1", "--threads", "1", "--ingress-replicas", "2"]
    args += ["--lora-root", str(tmp_path)]
    with ServeProcess(args, tmp_path / "serve.log") as server, httpx.Client(base_url=server.url, timeout=60) as http:
        server.wait_ready(timeout_s=180)
        want = http.post("/detokenize", json={"tokens": expected}).json()["prompt"]
        body = {"lora_name": "extra", "lora_path": str(tmp_path / "extra")}
        assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
        request = {"model": "extra", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}

        def statuses(n: int) -> list[int]:
            """``n`` requests on the adapter, spread by Serve's proxy over both ingress replicas."""
            replies = [http.post("/v1/completions", json=request) for _ in range(n)]
            assert all(r.json()["choices"][0]["text"] == want for r in replies if r.status_code == 200)
            return [r.status_code for r in replies]

        time.sleep(2.5)  # the other ingress reads the shared adapters each second
        assert statuses(12) == [200] * 12  # one ingress alone would 404 about half of them
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}).status_code == 200
        time.sleep(2.5)
        assert statuses(12) == [404] * 12
