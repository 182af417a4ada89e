"""``kvmesh status``: one look at a running cluster, from its ingress's ``/status`` endpoint."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from kvmesh.core.messages import ClusterStatus, ReplicaStatus


def fetch_status(url: str, timeout_s: float = 5.0, api_key: str | None = None) -> ClusterStatus:
    """A server's ``/status``; ``ConnectionError`` saying why when there is none to read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url.rstrip("/") + "/status", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return ClusterStatus.from_dict(json.loads(resp.read()))
    except ValueError as exc:  # not JSON, or not a status (MalformedReport)
        raise ConnectionError(f"{url}/status answered something that is not a kvmesh status: {exc}") from None
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise ConnectionError(f"{url} wants an API key: pass --api-key or set $KVMESH_API_KEY") from None
        raise ConnectionError(f"{url}/status answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ConnectionError(f"no kvmesh cluster answers at {url}: {exc}") from None


def format_table(headers: list[str], rows: list[list[str]], rule: bool = False) -> list[str]:
    """Left-aligned columns two spaces apart (``rule``: a dashed line under the headers); shared with the
    benchmarks' tables."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = [headers, *([["-" * w for w in widths]] if rule else []), *rows]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in lines]


def _host_tier(report: ReplicaStatus) -> list[str]:
    """The host prefix tier's hit rate and ``<blocks used>/<capacity>``; ``off`` without one."""
    if not report.host_tier_blocks:
        return ["off", "off"]
    return [f"{100 * report.host_hit_rate:.1f}%", f"{report.host_tier_used_blocks}/{report.host_tier_blocks}"]


def _disk_tier(report: ReplicaStatus) -> str:
    """The disk tier's ``<blocks used>/<capacity>``; ``off`` without one."""
    return f"{report.disk_tier_used_blocks}/{report.disk_tier_blocks}" if report.disk_tier_blocks else "off"


def _kv_moved(report: ReplicaStatus) -> str:
    """KV blocks fetched from peers / sent to peers, and fetches that fell back (``-`` before any transfer)."""
    if not (report.kv_fetches or report.kv_served_blocks):
        return "-"
    fell_back = sum(report.kv_fetch_fallbacks.values())
    return f"{report.kv_fetched_blocks}/{report.kv_served_blocks}" + (f" ({fell_back} fell back)" if fell_back else "")


def _row(replica: str, r: ReplicaStatus) -> list[str]:
    """One replica's line; ``?`` for the engine's counters when the replica could not read them."""
    engine = [
        f"{100 * r.kv_usage:.1f}%",
        f"{100 * r.prefix_hit_rate:.1f}%",
        *_host_tier(r),
        _disk_tier(r),
        str(r.num_running),
        str(r.num_waiting),
        str(r.num_preemptions),
        "?" if r.prefill_busy is None else f"{100 * r.prefill_busy:.0f}%",
        _kv_moved(r),
    ]
    return [replica, r.node or "?", *(["?"] * len(engine) if r.error is not None else engine), str(r.index_entries)]


def _redis_text(status: ClusterStatus) -> str:
    redis = status.redis
    if redis is None:
        return "not used"
    if not redis.ok:
        return "DOWN"
    text = f"ok, {redis.ping_ms} ms, {redis.used_memory}"
    if status.index_unreachable:
        text += f" (not from {len(status.index_unreachable)} replica(s))"
    return text


def render_status(status: ClusterStatus) -> str:
    """``kvmesh status``'s text."""
    out = [
        f"model {status.model}   policy {status.policy}   "
        f"index {status.index.entries} entries   Redis {_redis_text(status)}",
        "",
    ]
    rows = [_row(rid, report) for rid, report in sorted(status.replicas.items())]
    headers = ["REPLICA", "NODE", "KV USED", "HIT RATE", "HOST HIT", "HOST BLOCKS", "DISK BLOCKS", "RUNNING"]
    out += format_table([*headers, "WAITING", "PREEMPTED", "PREFILL BUSY", "KV IN/OUT", "INDEXED"], rows)
    if not rows:
        out.append("(no replica reports: replicas starting, or Redis unreachable)")
    for rid, cut in sorted(status.index_unreachable.items()):
        out.append(f"replica {rid} on {cut.node or '?'} cannot reach the index: {cut.error}")
    if status.live_replicas == 0:
        out.append("no live engine replica: requests get 503 until one returns")
    out.append("")
    decisions = [[d.policy, d.reason, str(d.count)] for d in status.decisions]
    out += format_table(["POLICY", "ROUTING REASON", "DECISIONS"], decisions)
    if not decisions:
        out.append("(no routing decisions yet)")
    return "\n".join(out)
