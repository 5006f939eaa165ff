"""Which all-reduce algorithm ``all_reduce(algo="auto")`` runs, per (GPU, world size, bytes).

A *table* is a JSON file measured by ``llcomm tune`` (or derived from a ``llcomm bench tp
--algos all`` result file). ``Communicator`` resolves one at construction, in this order:

1. the user's table: the file named by ``LLCOMM_TUNE_TABLE``, else
   ``$XDG_CACHE_HOME/llcomm/tune-<gpu>-w<W>.json`` (``~/.cache`` without XDG_CACHE_HOME),
   if it exists and was measured on this GPU model with this world size;
2. the tables shipped in the package (``llcomm/tp/tables/*.json``) for this GPU and world size;
3. the built-in rule, ``llcomm.tp.AUTO_TABLE``.

A table for another GPU or world size is skipped (logged); a malformed one raises
``AlgoTableError`` naming the file. Either way the result is compiled into a ``Selection``: sorted
byte limits and the algorithm of each interval, so the per-call lookup is one ``bisect``.

File format (``FORMAT`` = 1; extra keys are allowed and ignored)::

    {"llcomm_algo_table": 1, "op": "all_reduce", "device": "NVIDIA H200", "world_size": 2,
     "dtype": "bfloat16", "commit": "...", "versions": {"torch": "...", "triton": "..."},
     "rows": [{"max_bytes": 1048576, "algo": "lamport"},
              {"max_bytes": 8388608, "algo": "one_shot"},
              {"max_bytes": 16777216, "algo": "two_shot"}],
     "times_us": [{"bytes": 8, "one_shot": 4.2, "two_shot": 6.9, "lamport": 2.6}, ...]}

A row covers the sizes above the previous row's ``max_bytes`` up to its own; sizes above the
last row use the last row's algorithm. The table is looked up by bytes whatever the dtype (it
is measured in one dtype, recorded in ``dtype``).
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import AlgoTableError

log = logging.getLogger("llcomm")

#: Version of the table file format; a file with another version is refused.
FORMAT = 1
#: Key that marks a file as an llcomm algorithm table (its value is the format version).
FORMAT_KEY = "llcomm_algo_table"
#: The algorithms a table may name, in the order that breaks ties between equal times.
TABLE_ALGOS = ("lamport", "one_shot", "two_shot")
#: Folder of the tables that ship with the package.
SHIPPED_DIR = Path(__file__).resolve().parent / "tables"


@dataclass(frozen=True)
class Table:
    """A parsed table: ``rows`` are (max_bytes, algo), max_bytes strictly increasing."""
    device: str
    world_size: int
    rows: tuple[tuple[int, str], ...]
    path: str = "<memory>"


@dataclass(frozen=True)
class Selection:
    """The compiled choice: sizes up to ``limits[i]`` (and above ``limits[i - 1]``) run
    ``algos[i]``; sizes above every limit run ``algos[-1]``. ``len(algos) == len(limits) + 1``."""
    limits: tuple[int, ...]
    algos: tuple[str, ...]
    source: str

    def choose(self, nbytes: int) -> str:
        return self.algos[bisect.bisect_left(self.limits, nbytes)]


# -- names and paths ------------------------------------------------------------------------
def device_key(name: str) -> str:
    """Normalised GPU model for matching: 'NVIDIA H200' and 'H200' are the same GPU."""
    key = re.sub(r"\s+", " ", str(name)).strip().lower()
    return key.removeprefix("nvidia ").strip()


def user_table_path(device: str, world_size: int, tune_table: str | None) -> Path:
    """Where ``llcomm tune`` writes, and Communicator looks first: ``tune_table`` (the
    ``LLCOMM_TUNE_TABLE`` setting) if set, else ``<cache>/llcomm/tune-<gpu>-w<W>.json``."""
    if tune_table:
        return Path(tune_table).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    slug = re.sub(r"[^a-z0-9]+", "-", str(device).lower()).strip("-") or "gpu"
    return Path(cache) / "llcomm" / f"tune-{slug}-w{world_size}.json"


# -- parsing --------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse(doc, path: str = "<memory>") -> Table:
    """Check a decoded table document; raise one AlgoTableError listing every problem."""
    problems: list[str] = []
    if not isinstance(doc, dict):
        raise AlgoTableError(f"llcomm algorithm table {path}: expected a JSON object, got "
                             f"{type(doc).__name__}")
    if doc.get(FORMAT_KEY) != FORMAT:
        problems.append(f"{FORMAT_KEY}={doc.get(FORMAT_KEY)!r}; expected {FORMAT} (is this a "
                        "file written by `llcomm tune`?)")
    if doc.get("op", "all_reduce") != "all_reduce":
        problems.append(f"op={doc.get('op')!r}; expected 'all_reduce'")
    device = doc.get("device")
    if not isinstance(device, str) or not device.strip():
        problems.append(f"device={device!r}; expected the GPU name, e.g. 'NVIDIA H200'")
    ws = doc.get("world_size")
    if not _is_int(ws) or ws < 2:
        problems.append(f"world_size={ws!r}; expected an int >= 2")
    rows = doc.get("rows")
    parsed: list[tuple[int, str]] = []
    if not isinstance(rows, list) or not rows:
        problems.append("rows must be a non-empty list of {\"max_bytes\": int, \"algo\": str}")
        rows = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            problems.append(f"rows[{i}]={row!r}; expected an object with max_bytes and algo")
            continue
        mb, algo = row.get("max_bytes"), row.get("algo")
        ok = True
        if not _is_int(mb) or mb <= 0:
            problems.append(f"rows[{i}].max_bytes={mb!r}; expected a positive int")
            ok = False
        if algo not in TABLE_ALGOS:
            problems.append(f"rows[{i}].algo={algo!r}; expected one of {', '.join(TABLE_ALGOS)}")
            ok = False
        if ok and parsed and mb <= parsed[-1][0]:
            problems.append(f"rows[{i}].max_bytes={mb} does not exceed the previous row's "
                            f"{parsed[-1][0]}; rows must be in increasing max_bytes")
            ok = False
        if ok:
            parsed.append((mb, algo))
    if problems:
        raise AlgoTableError(f"llcomm algorithm table {path}: " + "; ".join(problems)
                             + ". Fix or delete the file.")
    return Table(device=device.strip(), world_size=ws, rows=tuple(parsed), path=path)


def load(path) -> Table:
    """Read and check the table at ``path``; AlgoTableError (naming the file) if it is bad."""
    path = str(path)
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise AlgoTableError(f"llcomm algorithm table {path}: not valid JSON ({e}). Fix or "
                             "delete the file.") from None
    except OSError as e:
        raise AlgoTableError(f"llcomm algorithm table {path}: cannot be read ({e})") from None
    return parse(doc, path)


# -- building tables from measurements ------------------------------------------------------
def winners(times_us: dict[int, dict[str, float | None]]) -> dict[int, str]:
    """Per size, the algorithm with the smallest time (None = not run or failed; ties go to
    the earlier one in TABLE_ALGOS). Sizes where nothing ran are left out."""
    out = {}
    for nbytes in sorted(times_us):
        ran = [(t, TABLE_ALGOS.index(a), a) for a, t in times_us[nbytes].items()
               if a in TABLE_ALGOS and t is not None]
        if ran:
            out[nbytes] = min(ran)[2]
    return out


def merge(win: dict[int, str]) -> list[tuple[int, str]]:
    """Adjacent measured sizes with the same winner become one row whose max_bytes is the
    largest of them: {8: a, 16: a, 32: b} -> [(16, a), (32, b)]."""
    rows: list[tuple[int, str]] = []
    for nbytes in sorted(win):
        if rows and rows[-1][1] == win[nbytes]:
            rows[-1] = (nbytes, win[nbytes])
        else:
            rows.append((nbytes, win[nbytes]))
    return rows


def document(device: str, world_size: int, times_us: dict[int, dict[str, float | None]],
             **meta) -> dict:
    """The JSON object of a table measured as ``times_us`` ({bytes: {algo: median µs}})."""
    rows = merge(winners(times_us))
    if not rows:
        raise ValueError("no algorithm produced a time at any size: nothing to tabulate")
    doc = {FORMAT_KEY: FORMAT, "op": "all_reduce", "device": device, "world_size": world_size,
           **meta, "rows": [{"max_bytes": mb, "algo": a} for mb, a in rows],
           "times_us": [{"bytes": b, **{a: times_us[b].get(a) for a in TABLE_ALGOS}}
                        for b in sorted(times_us)]}
    parse(doc)  # what we write must be what we accept
    return doc


# -- compiling and resolving ----------------------------------------------------------------
def _first_match(rows, nbytes: int, beyond: str, lamport_cap: int | None) -> str:
    for limit, algo in rows:
        if nbytes <= limit:
            if algo == "lamport" and lamport_cap is not None and nbytes > lamport_cap:
                continue
            return algo
    return beyond


def compile_rows(rows, beyond: str, source: str, lamport_cap: int | None = None) -> Selection:
    """Compile first-match ``rows`` of (max_bytes, algo) into a sorted Selection.

    A size matches the first row whose max_bytes it does not exceed; a Lamport row is skipped
    for sizes above ``lamport_cap`` (the communicator's Lamport buffer), and sizes that match
    no row run ``beyond``. Between two consecutive limits the answer cannot change, so
    evaluating the rule once per interval gives the whole function.
    """
    points = sorted({limit for limit, _ in rows} | ({lamport_cap} if lamport_cap else set()))
    limits: list[int] = []
    algos: list[str] = []
    for p in points:
        algo = _first_match(rows, p, beyond, lamport_cap)
        if algos and algos[-1] == algo:
            limits[-1] = p
        else:
            limits.append(p)
            algos.append(algo)
    last = _first_match(rows, (points[-1] + 1) if points else 1, beyond, lamport_cap)
    if algos and algos[-1] == last:
        limits.pop()
    else:
        algos.append(last)
    return Selection(tuple(limits), tuple(algos), source)


def table_selection(table: Table, lamport_cap: int | None = None) -> Selection:
    """A table's Selection: sizes above its last row keep the last row's algorithm (or
    one_shot where that is Lamport and the size is above ``lamport_cap``)."""
    rows = list(table.rows)
    beyond = rows[-1][1]
    if beyond == "lamport" and lamport_cap is not None:
        if lamport_cap > rows[-1][0]:
            rows.append((lamport_cap, "lamport"))
        beyond = "one_shot"
    return compile_rows(rows, beyond, f"table {table.path}", lamport_cap)


def matches(table: Table, device: str, world_size: int) -> bool:
    return table.world_size == world_size and device_key(table.device) == device_key(device)


def find_table(device: str, world_size: int, tune_table: str | None,
               shipped_dir=SHIPPED_DIR) -> Table | None:
    """The first table that applies to (device, world_size): the user's (``tune_table``, the
    ``LLCOMM_TUNE_TABLE`` setting, else the cache path), then the shipped ones in file-name
    order. None where none applies. A malformed table raises."""
    user = user_table_path(device, world_size, tune_table)
    if tune_table and not user.exists():
        log.warning("llcomm: LLCOMM_TUNE_TABLE=%s does not exist; using the shipped tables or "
                    "the built-in rule (run `llcomm tune` to measure one)", user)
    candidates = [user] if user.exists() else []
    candidates += sorted(Path(shipped_dir).glob("*.json")) if Path(shipped_dir).is_dir() else []
    for path in candidates:
        table = load(path)
        if matches(table, device, world_size):
            return table
        log.info("llcomm: algorithm table %s is for %s with world size %d, not %s with %d; "
                 "skipped", path, table.device, table.world_size, device, world_size)
    return None
