"""Plain-text tables for the operator commands (``keys list``, ``ledger summary``, ``cluster
status``): columns padded to their widest cell, two spaces apart, no trailing blanks, so the
output reads in a terminal and greps line by line."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["aligned_rows"]


def aligned_rows(table: Sequence[Sequence[str]]) -> list[str]:
    """The rows of ``table`` (a header row first, every row the same length) as aligned lines."""
    if not table:
        return []
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
