"""What the benchmarks print: a progress bar (or progress lines in a log), tables, and numbers
formatted for them."""
from __future__ import annotations

import contextlib
import math
import sys
import time

#: Without a terminal (a log file, a batch job's output), progress is a plain line at each tenth
#: of the work: a live bar writes nothing there, and a run killed by a timeout would otherwise
#: leave no trace of how far it got.
LOG_LINES = 10


class _NoProgress:
    def advance(self, text: str = "") -> None:
        pass


class _LogLines:
    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done, self.t0 = max(total, 1), desc, 0, time.perf_counter()
        self.next_at = self.total / LOG_LINES

    def advance(self, text: str = "") -> None:
        self.done += 1
        if self.done >= self.next_at or self.done == self.total:
            self.next_at += self.total / LOG_LINES
            print(f"{self.desc}: {self.done}/{self.total} {text} "
                  f"({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def progress(total: int, desc: str, enabled: bool = True):
    """A progress bar on stderr (rich, else tqdm, else nothing; plain lines without a terminal);
    yields ``.advance(text)``, one call per unit of ``total``."""
    if not enabled:
        yield _NoProgress()
        return
    if not sys.stderr.isatty():
        yield _LogLines(total, desc)
        return
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        Progress = None
    if Progress is not None:
        with Progress(console=Console(stderr=True), transient=True) as p:
            task = p.add_task(desc, total=total)

            class _Rich:
                def advance(self, text: str = "") -> None:
                    p.update(task, advance=1, description=f"{desc} {text}")
            yield _Rich()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield _NoProgress()
        return
    with tqdm(total=total, desc=desc, file=sys.stderr, leave=False) as bar:
        class _Tqdm:
            def advance(self, text: str = "") -> None:
                bar.set_postfix_str(text)
                bar.update(1)
        yield _Tqdm()


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    """A rich table on a terminal, plain right-aligned columns otherwise (pipes, logs, tests)."""
    try:
        from rich.console import Console
        from rich.table import Table
        console = Console()
        rich_ok = console.is_terminal
    except ImportError:
        rich_ok = False
    if rich_ok:
        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="right")
        for r in rows:
            table.add_row(*r)
        console.print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    print(f"# {title}")
    print("# " + "  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))


def fmt_us(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def fmt_bytes(n: int) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
