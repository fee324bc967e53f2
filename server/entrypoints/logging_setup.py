"""The server's logging: a level, a format (plain text or one JSON object per line), and the
WebSocket library kept quiet.

websockets logs every connection at INFO (``connection open``, ``connection rejected (200 OK)``,
``connection closed``): one line per health probe, which buried everything else. Its loggers are
held at WARNING unless ``DEBUG`` is asked for (and at DEBUG it logs frames and headers: never in
production). The server logs each session's open and close itself, with the tenant, mode and
peer and without keys or payloads.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import IO, Any

__all__ = ["LOG_FORMATS", "JsonFormatter", "configure_logging"]

#: ``--log-format`` choices.
LOG_FORMATS = ("text", "json")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Attributes every ``LogRecord`` has; anything else on a record came from ``extra=`` and is a
#: structured field of the line.
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}

#: Third-party loggers that log per connection at INFO.
_CHATTY_LOGGERS = ("websockets",)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``, the
    record's structured fields (its ``extra=``), and ``exception`` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRIBUTES and key not in line:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def configure_logging(level: str = "INFO", fmt: str = "text", stream: IO[str] | None = None) -> None:
    """Set up the root logger for a server process (replacing any handler it had).

    Args:
        level: a level name (``INFO``, ``debug``, ...).
        fmt: ``text`` or ``json``.
        stream: where lines go (stderr by default).
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    root.setLevel(numeric)
    logging.captureWarnings(True)  # Python warnings become log lines too (and JSON ones in that format)
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
