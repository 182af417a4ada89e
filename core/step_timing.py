"""How long an engine step takes, as a timing model: the one definition behind the fleet simulator's replicas
(``benchmarks/harness/fleet_sim.py``) and the simulated engine (``replica/simulated.py``), so a fleet of simulated
engines and the discrete-event simulator price the same work the same way."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepTiming:
    """A step costs ``min_step_s + decodes * decode_s_per_seq + prefill_tokens / prefill_tok_s``: the fit
    ``kvmesh bench calibrate`` measures on our real engine. The defaults are a GPU-class replica (prefill
    20,000 tokens/s, a decode step 15 ms plus 0.25 ms per running sequence), documented, not measured."""

    prefill_tok_s: float = 20_000.0
    decode_s_per_seq: float = 0.00025
    """Seconds one running sequence adds to a decode step."""
    min_step_s: float = 0.015
    """A step's base cost."""

    def __post_init__(self) -> None:
        if self.prefill_tok_s <= 0 or self.decode_s_per_seq < 0 or self.min_step_s < 0:
            raise ValueError(f"step timing needs prefill_tok_s > 0 and non-negative step costs, got {self}")

    def step_s(self, prefill_tokens: int, decodes: int) -> float:
        """Seconds one step of ``prefill_tokens`` prompt tokens and ``decodes`` decoding sequences takes."""
        return self.min_step_s + decodes * self.decode_s_per_seq + prefill_tokens / self.prefill_tok_s

    @classmethod
    def from_calibration(cls, path: Path, speedup: float | None = None):
        """The engine ``kvmesh bench calibrate`` measured (its JSON at ``path``), ``speedup`` times faster
        (default: to the default prefill rate); with the factor used."""
        cal = json.loads(Path(path).read_text())
        f = speedup or cls.prefill_tok_s / cal["prefill_tok_s"]
        return cls(cal["prefill_tok_s"] * f, cal["decode_s_per_seq"] / f, cal["step_base_s"] / f), f

    @classmethod
    def parse(cls, spec: str) -> StepTiming:
        """``default``, a calibration JSON file (``PATH`` or ``PATH:SPEEDUP``), or
        ``prefill_tok_s=..,decode_s_per_seq=..,min_step_s=..`` (any subset; the rest default)."""
        if spec in ("", "default"):
            return cls()
        if "=" in spec:
            fields = {}
            for part in spec.split(","):
                name, _, value = part.partition("=")
                if name.strip() not in cls.__dataclass_fields__:
                    raise ValueError(f"unknown step timing field {name!r} in {spec!r}")
                fields[name.strip()] = float(value)
            return cls(**fields)
        path, _, speedup = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
        if not Path(path).is_file():
            raise ValueError(f"step timing {spec!r}: no such calibration file (or give name=value pairs)")
        return cls.from_calibration(Path(path), float(speedup) if speedup else None)[0]
