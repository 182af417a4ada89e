"""The front door's refusals (API keys, body size, in-flight limit) on a small ASGI app, in process."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvmesh.cluster.ingress.admission import (
    API_KEYS_ENV,
    TENANT_STATE,
    Admission,
    AdmissionMiddleware,
    ApiKeys,
    key_digests,
)


class EchoApp:
    """Streams the request body back in two chunks; a POST waits on ``gate`` (if set) before the second."""

    def __init__(self) -> None:
        self.gate: asyncio.Event | None = None

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"got:", "more_body": True})
        if self.gate is not None and scope["method"] == "POST":
            await self.gate.wait()
        await send({"type": "http.response.body", "body": body})


def client_for(admission: Admission, app: EchoApp | None = None) -> httpx.AsyncClient:
    asgi = AdmissionMiddleware(app or EchoApp(), lambda: admission)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://kvmesh")


def test_api_keys_guard_the_api_but_not_probes(monkeypatch):
    monkeypatch.setenv(API_KEYS_ENV, " from-secret ,")
    admission = Admission(key_digests(["k1"]))

    async def main():
        async with client_for(admission) as c:
            out = {}
            sent = {
                "none": None,
                "wrong": "Bearer k2",
                "basic": "Basic k1",
                "k1": "Bearer k1",
                "env": "bearer from-secret",
            }
            for name, auth in sent.items():
                headers = {"Authorization": auth} if auth else {}
                out[name] = await c.post("/v1/completions", content=b"x", headers=headers)
            out["health"] = await c.get("/health")
            out["status"] = await c.get("/status")
            return out

    out = asyncio.run(main())
    for name in ("none", "wrong", "basic", "status"):
        assert out[name].status_code == 401, name
    assert out["none"].json()["error"]["code"] == "invalid_api_key"
    assert out["none"].headers["www-authenticate"] == "Bearer"
    assert out["k1"].status_code == out["env"].status_code == out["health"].status_code == 200
    assert not ApiKeys([]).enabled and ApiKeys([]).tenant(None) == ""


def test_oversized_bodies_get_413_with_or_without_a_length():
    admission = Admission(max_body_bytes=100)

    async def chunks(n: int):
        for _ in range(n):
            yield b"0123456789"

    async def main():
        async with client_for(admission) as c:
            return (
                await c.post("/v1/completions", content=b"y" * 101),
                await c.post("/v1/completions", content=chunks(11)),  # streamed: no Content-Length
                await c.post("/v1/completions", content=chunks(10)),
            )

    big, streamed_big, streamed_ok = asyncio.run(main())
    assert big.status_code == streamed_big.status_code == 413
    assert big.json()["error"]["code"] == "request_too_large"
    assert streamed_ok.status_code == 200 and streamed_ok.text == "got:" + "0123456789" * 10


def test_generations_beyond_the_in_flight_limit_get_429_until_one_finishes():
    admission, app = Admission(max_inflight=2), EchoApp()

    async def main():
        app.gate = asyncio.Event()
        async with client_for(admission, app) as c:
            held = [asyncio.create_task(c.post("/v1/chat/completions", content=b"a")) for _ in range(2)]
            while admission.inflight.inflight < 2:  # both streams started and are waiting on the gate
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/completions", content=b"b")
            other = await c.get("/v1/models")  # not a generation: never refused for capacity
            app.gate.set()
            done = await asyncio.gather(*held)
            after = await c.post("/v1/completions", content=b"c")
            return refused, other, done, after

    refused, other, done, after = asyncio.run(main())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert other.status_code == 200
    assert [r.text for r in done] == ["got:a", "got:a"]
    assert after.status_code == 200 and admission.inflight.inflight == 0 and admission.inflight.refused == 1


def test_limits_are_validated():
    with pytest.raises(ValueError):
        Admission(max_inflight=-1)


class TenantApp:
    """Answers with the tenant the middleware identified."""

    async def __call__(self, scope, receive, send) -> None:
        body = scope["state"][TENANT_STATE].encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def test_each_key_is_its_own_tenant_and_a_route_prefix_does_not_skip_the_check():
    """Ray Serve mounts an app under a route prefix by setting ``root_path``: the key check must apply to
    the path the app routes (``/v1/...``), not the raw one (``/prefix/v1/...``)."""
    admission = Admission(key_digests(["k1", "k2"]))

    async def main():
        asgi = AdmissionMiddleware(TenantApp(), lambda: admission)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=asgi, root_path="/kv"), base_url="http://x"
        ) as c:
            return [
                await c.get("/kv/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
                for key in ("k1", "k2", "k1", None)
            ]

    k1, k2, k1_again, anonymous = asyncio.run(main())
    assert k1.status_code == k2.status_code == 200 and k1.text == k1_again.text != k2.text
    assert len(k1.text) == 64  # a digest: the key itself never reaches the app
    assert anonymous.status_code == 401


def test_api_docs_are_off_unless_enabled():
    async def get(admission: Admission, path: str) -> httpx.Response:
        async with client_for(admission) as c:
            return await c.get(path)

    for path in ("/docs", "/redoc", "/openapi.json"):
        off = asyncio.run(get(Admission(), path))
        assert off.status_code == 404 and off.json()["error"]["message"]
        assert asyncio.run(get(Admission(enable_docs=True), path)).status_code == 200
