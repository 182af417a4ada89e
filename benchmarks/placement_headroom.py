"""How much of a router run's mean TTFT placement could still win, recomputed from a saved result.

    kvmesh bench placement_headroom benchmarks/results/peer_routers.json

recomputes every run of a saved ``kvmesh bench peer_routers`` result and prints, per workload, router and run:
its mean TTFT, the share of its requests held by affinity (at least half the prompt cached where it went),
the mean placement alone could reach (every placed request on an idle engine), the no-wait floor and the held
requests' wait (``benchmarks/harness/placement_estimate.py`` defines them), with how many placed requests went
to an engine where the fewest prefills were in flight when they were sent.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.bench.harness.placement_estimate import reanalyse
from kvmesh.bench.harness.report import print_table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="kvmesh bench placement_headroom",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("result", type=Path, help="a saved peer_routers result (JSON)")
    args = ap.parse_args(argv)
    header = ["workload", "router", "run", "TTFT mean ms", "held", "placement estimate ms", "no-wait floor ms"]
    print_table([*header, "held wait ms", "placed on freest"], reanalyse(args.result))


if __name__ == "__main__":
    main()
