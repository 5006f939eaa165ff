"""The in-host stages of the two-level EP cost model (``ep_model``): what forwarding rows,
forming partials and folding host sums inside a host cost, as lines in the bytes a GPU moves
(``HostExchange``), and where they come from (``InHost``):

- ``SCALED``: the single-host peer kernels' dispatch and combine measured on 2 GPUs, fitted
  as a line through two token counts and evaluated at the bytes a forwarder moves at 8 GPUs
  per host: a scaling, not a measurement of these stages;
- a calibration file (``ep_calibrate``, ``llcomm bench ep --calibrate``): the stages
  themselves timed on one GPU at EP16 and EP64 sizes (rows of ``stage``, ``ranks``, ``bytes``
  and ``median_us``), a line per stage through its points (``calibrated``);
  ``newest_calibration`` finds the newest one in ``bench/results/``.

On one GPU the stages write into that GPU's memory, not over NVLink, so the model keeps the
NVLink time of their bytes as a floor on each in-host stage (``ep_model._in_host``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

#: Bytes per µs in one GB/s (10^9 bytes per second).
BYTES_PER_US_PER_GBPS = 1e3

#: The peer kernels' FP8 dispatch on 2xH200: (payload bytes per rank, median µs) at 128 and 256
#: tokens (bench/results/h200x2-ep-b256.json, commit 68e11b7, CUDA-graph rows).
PEER_DISPATCH_FP8 = ((1_884_960, 13.2288), (3_773_616, 23.3584))
#: The peer kernels' bf16 combine on 2xH200, the same run and rows.
PEER_COMBINE_BF16 = ((3_655_680, 13.6352), (7_318_528, 24.3568))



@dataclass(frozen=True)
class HostExchange:
    """An in-host stage's time as ``fixed_us + bytes / gbps``, ``bytes`` the payload a GPU
    writes (its own rows included, as ``llcomm bench ep`` counts ``bytes``). A negative
    ``fixed_us`` comes only from ``fit`` through two measured points between which the stage
    grows faster than its bytes (with the sources a block walks, say): then the line is an
    interpolation between them, and ``us`` is never below 0."""

    fixed_us: float
    gbps: float

    def __post_init__(self):
        if not (math.isfinite(self.fixed_us) and self.gbps > 0 and math.isfinite(self.gbps)):
            raise ValueError(f"{self}: expected a finite fixed_us and gbps > 0")

    @classmethod
    def fit(cls, points) -> HostExchange:
        """The least-squares line through measured ``(bytes, µs)`` points (through both of two,
        whatever its fixed part); through the origin from one point, or where more than two
        would give a line starting below 0 µs or not rising."""
        pts = [(float(b), float(t)) for b, t in points]
        if not pts or any(b <= 0 or t <= 0 or not math.isfinite(t) for b, t in pts):
            raise ValueError(f"{points}: expected (bytes, µs) points, each positive")
        n = len(pts)
        mb, mt = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
        var = sum((b - mb) ** 2 for b, _ in pts)
        per_byte = sum((b - mb) * (t - mt) for b, t in pts) / var if var else 0.0
        fixed = mt - mb * per_byte
        if per_byte <= 0 or (fixed < 0 and n != 2):     # through the origin: µs per byte
            per_byte, fixed = sum(t for _, t in pts) / sum(b for b, _ in pts), 0.0
        return cls(fixed, 1.0 / (per_byte * BYTES_PER_US_PER_GBPS))

    def us(self, nbytes: float) -> float:
        return max(0.0, self.fixed_us + self.per_byte_us(nbytes))

    def per_byte_us(self, nbytes: float) -> float:
        """The time of ``nbytes`` more within a running stage: the line's slope, no fixed part."""
        return nbytes / (self.gbps * BYTES_PER_US_PER_GBPS)


@dataclass(frozen=True)
class InHost:
    """What the in-host stages cost, and where that comes from (``source``: ``"scaled"``, the
    peer kernels' 2-GPU measurements scaled by bytes; ``"calibrated"``, the stages timed on one
    GPU, ``ep_calibrate``). ``host_sums``: the fold of the partials, or None where the
    ``partials`` cost includes it (the 2-GPU combine does). ``note`` says which measurement."""

    source: str
    note: str
    forward: HostExchange
    partials: HostExchange
    host_sums: HostExchange | None = None

    @property
    def bound(self) -> str:
        """What an in-host stage is bound by when its cost here exceeds the NVLink time."""
        return f"in host ({self.source})"


#: The in-host stages without a calibration: the 2-GPU peer kernels' lines.
SCALED = InHost("scaled", "the peer kernels on 2xH200 scaled by bytes (not measured at this "
                "size; bench/results/h200x2-ep-b256.json)",
                HostExchange.fit(PEER_DISPATCH_FP8), HostExchange.fit(PEER_COMBINE_BF16))


# -- calibration files --------------------------------------------------------------------------
#: Where result files are committed, and the end of a calibration file's name
#: (``<gpu>x1-ep-calibration.json``, ``ep_calibrate.default_path``).
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
CALIBRATION_SUFFIX = "-ep-calibration.json"
#: The stages a calibration times, by the names of its rows' ``stage`` (``ep_calibrate``), and
#: the EP sizes it times them at (hosts of 8 GPUs: 2 and 8 hosts).
CALIBRATED_STAGES = ("forward", "partials", "host sums")
CALIBRATION_EPS = (16, 64)


def calibrated(result: dict, name: str = "calibration") -> InHost:
    """The in-host costs of a calibration result (``ep_calibrate``): per stage, the line through
    its rows' ``(bytes, median_us)`` (``HostExchange.fit``). ValueError naming what is missing
    or bad."""
    rows = result.get("rows")
    if not isinstance(rows, list):
        raise ValueError(f"{name}: no 'rows' list: not a calibration result file")
    lines = {}
    for stage in CALIBRATED_STAGES:
        points = [(r.get("bytes"), r.get("median_us")) for r in rows
                  if isinstance(r, dict) and r.get("stage") == stage]
        try:
            lines[stage] = HostExchange.fit(points)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name}: stage {stage!r}: {e}") from e
    shapes = sorted({r.get("ranks") for r in rows if isinstance(r, dict)} - {None})
    note = (f"calibrated on {result.get('machine', '?')} at commit "
            f"{str(result.get('commit'))[:7]} ({name}, EP {'/'.join(map(str, shapes))}), "
            "one GPU standing in for a host")
    return InHost("calibrated", note, lines["forward"], lines["partials"], lines["host sums"])


def load_calibration(path) -> InHost:
    """``calibrated`` of the result file at ``path``; ValueError if it cannot be used."""
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a calibration result: {e}") from e
    if not isinstance(result, dict):
        raise ValueError(f"{path}: not a calibration result file")
    return calibrated(result, path.name)


def newest_calibration(folder: Path | None = None) -> Path | None:
    """The calibration file of ``folder`` (default ``RESULTS``) with the latest ``date`` (then
    name), or None."""
    best = None
    for path in sorted(Path(folder or RESULTS).glob("*" + CALIBRATION_SUFFIX)):
        try:
            date = str(json.loads(path.read_text()).get("date", ""))
        except (OSError, ValueError, AttributeError):
            date = ""
        if best is None or (date, path.name) >= best[0]:
            best = ((date, path.name), path)
    return None if best is None else best[1]
