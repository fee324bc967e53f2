"""What every bench command writes: a results folder with JSON lines, a summary table on
stdout, and progress lines on stderr.

A results folder holds ``results.jsonl`` (one JSON object per line, each with ``suite`` and
``kind``), the suite's PNG plots and, for some suites, ``requests.jsonl`` (one line per
request) and ``report.md``. Non-finite numbers are written as ``null`` so any JSON reader
takes the files.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

__all__ = ["Column", "Progress", "ResultsDir", "format_table", "jsonable", "read_jsonl", "default_out"]


def jsonable(obj: Any) -> Any:
    """``obj`` with numpy scalars and arrays made plain, tuples made lists, NaN and
    infinities made ``None``, and dataclass-like objects (``as_dict``) expanded.

    Args:
        obj: what to convert.
    """
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else None
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "as_dict"):
        return jsonable(obj.as_dict())
    return obj


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """Every object in a JSON-lines file.

    Args:
        path: the file.
    """
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def default_out(suite: str) -> Path:
    """Where a suite writes when no ``--out`` is given: ``results/<suite>``.

    Args:
        suite: the suite's name.
    """
    return Path("results") / suite


class ResultsDir:
    """A suite's results folder.

    Args:
        path: the folder (created if missing).
        suite: the suite's name, stamped on every record.
        fresh: remove this suite's previous ``results.jsonl`` and ``requests.jsonl`` first,
            so a folder holds one run (plots are overwritten anyway).
    """

    def __init__(self, path: Path | str, suite: str, *, fresh: bool = True) -> None:
        self.path = Path(path)
        self.suite = suite
        self.path.mkdir(parents=True, exist_ok=True)
        self.results = self.path / "results.jsonl"
        self.requests = self.path / "requests.jsonl"
        if fresh:
            for p in (self.results, self.requests):
                p.unlink(missing_ok=True)
        self.written: list[Path] = []

    def write(self, kind: str, record: Mapping[str, Any]) -> None:
        """Append one result object (``suite`` and ``kind`` added) to ``results.jsonl``."""
        with open(self.results, "a") as f:
            f.write(json.dumps(jsonable({"suite": self.suite, "kind": kind, **record})) + "\n")

    def write_requests(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Append per-request rows to ``requests.jsonl``."""
        with open(self.requests, "a") as f:
            for row in rows:
                f.write(json.dumps(jsonable(row)) + "\n")

    def file(self, name: str) -> Path:
        """A path inside the folder, remembered for the closing listing."""
        p = self.path / name
        self.written.append(p)
        return p

    def write_text(self, name: str, text: str) -> Path:
        p = self.file(name)
        p.write_text(text)
        return p

    def listing(self) -> str:
        """A line naming what the run wrote."""
        names = ["results.jsonl"] + (["requests.jsonl"] if self.requests.exists() else [])
        names += [p.name for p in self.written if p.exists()]
        return f"results in {self.path}/: {', '.join(dict.fromkeys(names))}"


class Column:
    """One column of a summary table.

    Args:
        header: the column title.
        get: the cell value from a row.
        fmt: a format spec (``".2f"``) or a callable; NaN and ``None`` show as ``n/a``.
        align: ``">"`` (numbers) or ``"<"`` (text).
    """

    def __init__(self, header: str, get: Callable[[Any], Any] | str, fmt: str | Callable[[Any], str] = "",
                 align: str = ">") -> None:
        self.header = header
        # A name reads a mapping's key or an object's attribute.
        self.get = (lambda row: row[get] if isinstance(row, Mapping) else getattr(row, get)) if isinstance(get, str) else get
        self.fmt = fmt
        self.align = align

    def cell(self, row: Any) -> str:
        try:
            value = self.get(row)
        except (KeyError, IndexError, AttributeError):
            return "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "n/a"
        if callable(self.fmt):
            return self.fmt(value)
        return format(value, self.fmt)


def format_table(rows: Sequence[Any], columns: Sequence[Column], *, title: str | None = None) -> str:
    """A plain-text table, columns as wide as their widest cell.

    Args:
        rows: one object per row (whatever the columns' getters read).
        columns: the columns.
        title: a line above the table.
    """
    cells = [[c.cell(r) for c in columns] for r in rows]
    widths = [max([len(c.header)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(f"{v:{c.align}{w}}" for v, c, w in zip(values, columns, widths, strict=False)).rstrip()

    out = [title] if title else []
    out.append(line([c.header for c in columns]))
    out.append("  ".join("-" * w for w in widths))
    out += [line(row) for row in cells]
    return "\n".join(out)


class Progress:
    """A progress bar as plain lines on stderr, at most one per ``interval`` seconds.

    Args:
        total: units of work (0: unknown, no percentage).
        label: what is being done.
        stream: where lines go.
        interval: least seconds between lines.
        clock: seconds (injectable for tests).
        width: characters of the bar.
    """

    def __init__(self, total: float, label: str, *, stream: TextIO | None = None, interval: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, width: int = 24) -> None:
        self.total = float(total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.clock = clock
        self.width = width
        self.done = 0.0
        self.started = clock()
        self._last = -math.inf
        self.lines = 0

    def render(self, extra: str = "") -> str:
        elapsed = self.clock() - self.started
        if self.total > 0:
            frac = min(1.0, max(0.0, self.done / self.total))
            filled = int(round(frac * self.width))
            eta = elapsed * (1 - frac) / frac if frac > 0 else math.nan
            eta_text = f" eta {eta:5.1f}s" if math.isfinite(eta) else ""
            head = f"[{'#' * filled}{'.' * (self.width - filled)}] {100 * frac:5.1f}% {self.done:g}/{self.total:g}"
            text = f"{self.label} {head} {elapsed:6.1f}s{eta_text}"
        else:
            text = f"{self.label} {self.done:g} done {elapsed:6.1f}s"
        return f"{text}  {extra}".rstrip()

    def update(self, done: float | None = None, *, advance: float = 0.0, extra: str = "", force: bool = False) -> None:
        """Set (or advance) the work done; print a line if ``interval`` has passed.

        Args:
            done: the new total done.
            advance: added to the total done.
            extra: text after the bar (live figures).
            force: print now.
        """
        self.done = (self.done if done is None else float(done)) + advance
        now = self.clock()
        if force or now - self._last >= self.interval:
            self._last = now
            self.stream.write(self.render(extra) + "\n")
            self.stream.flush()
            self.lines += 1

    def close(self, extra: str = "") -> None:
        """The final line."""
        self.update(force=True, extra=extra)
