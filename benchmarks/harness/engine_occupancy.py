"""What the engines were doing during a router run: ``kvmesh engine``'s ``GET /load`` sampled at a fixed rate.

Answers where a request's time beyond an idle engine's goes: waiting in an engine's queue (a router could
have sent it elsewhere, or a scheduler served it sooner) or sharing steps and cores with busy neighbours.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

PROBE_INTERVAL_S = 0.05


@contextmanager
def probe(urls: list[str]) -> Iterator[list[list[tuple[int, int]]]]:
    """Sample every engine's running and waiting requests until the block ends; yields the list the samples
    (one ``(running, waiting)`` per engine each) are appended to."""
    samples: list[list[tuple[int, int]]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=5) as client:
            while not stop.is_set():
                row = []
                for url in urls:
                    load = client.get(url + "/load").json()
                    row.append((load["num_running"], load["num_waiting"]))
                samples.append(row)
                stop.wait(PROBE_INTERVAL_S)

    thread = threading.Thread(target=poll, name="occupancy-probe", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def summarize(samples: list[list[tuple[int, int]]]) -> dict:
    """The share of samples with 0, 1, 2, ... engines busy (a request running or waiting), and with any
    request waiting in some engine's queue."""
    if not samples:
        return {"samples": 0, "busy_engines_share": [], "waiting_share": None}
    busy = [sum(1 for running, waiting in row if running + waiting) for row in samples]
    engines = len(samples[0])
    return {
        "samples": len(samples),
        "busy_engines_share": [busy.count(k) / len(busy) for k in range(engines + 1)],
        "waiting_share": sum(1 for row in samples if any(waiting for _, waiting in row)) / len(samples),
    }
