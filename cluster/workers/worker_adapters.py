"""Which LoRA adapters an external worker serves, and which it has ready, from what it publishes.

- Served: its ``/v1/models`` (vLLM, SGLang and ``kvmesh engine`` list each adapter beside the base model, with
  ``parent`` naming it). A request on an adapter goes only to workers that list it, where any does: the others
  would answer 404.
- Ready: vLLM's ``vllm:lora_requests_info`` gauge: one sample per label set it has had, the current one
  holding the latest time; its running and waiting adapters (comma-separated) are the ones in its batch's
  LoRA slots, ``max_lora`` how many slots it has. A ``kvmesh engine`` reports the same in its ``/load``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

LORA_INFO = "vllm:lora_requests_info"


@dataclass(frozen=True)
class ReadyAdapters:
    """The adapters a worker's batch holds (running first, then waiting; no repeats) and its slots for them."""

    names: list[str]
    slots: int


def ready_adapters(metrics_text: str) -> ReadyAdapters | None:
    """From a ``/metrics`` page, vLLM's current ``lora_requests_info``; None where the page has none."""
    lines = [ln for ln in metrics_text.splitlines() if LORA_INFO in ln.split("{", 1)[0]]
    try:
        samples = [s for f in text_string_to_metric_families("\n".join(lines) + "\n") for s in f.samples]
    except ValueError:
        return None
    if not samples:
        return None
    latest = max(samples, key=lambda s: s.value).labels
    names: list[str] = []
    for label in ("running_lora_adapters", "waiting_lora_adapters"):
        for name in latest.get(label, "").split(","):
            if name and name not in names:
                names.append(name)
    try:
        slots = int(latest.get("max_lora", ""))
    except ValueError:
        slots = len(names)
    return ReadyAdapters(names, slots)


def served_adapters(models_text: str) -> frozenset[str] | None:
    """From a ``/v1/models`` answer, the adapters listed (entries with a ``parent``); None if it is unreadable."""
    try:
        entries = json.loads(models_text)["data"]
        return frozenset(e["id"] for e in entries if e.get("parent"))
    except (ValueError, KeyError, TypeError):
        return None
