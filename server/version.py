"""The installed chunkline version, read from the package metadata (``pyproject.toml`` is the one place it is written)."""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["VERSION"]

try:
    VERSION = version("chunkline")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0+unknown"
