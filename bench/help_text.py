"""Module docstrings as ``--help`` descriptions, without their reStructuredText markup.

The suites' docstrings are written for the API docs (``code``, **bold**, :mod:`roles`); a help
screen shows them as plain text.
"""

from __future__ import annotations

import re

__all__ = ["plain_help"]

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :mod:`chunkline.bench.x` -> chunkline.bench.x
_LITERAL = re.compile(r"``([^`]+)``")
_STRONG = re.compile(r"\*\*([^*]+)\*\*")


def plain_help(doc: str | None) -> str:
    """``doc`` with roles, literals and bold reduced to their text (``\\\\`` line continuations kept)."""
    text = _ROLE.sub(r"\1", doc or "")
    text = _LITERAL.sub(r"\1", text)
    return _STRONG.sub(r"\1", text)
