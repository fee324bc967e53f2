"""``module:factory`` references: import the module (the current directory included), call the
factory with the policy's arguments, and wrap what it returns.

The ``chunkline`` console script does not put the current directory on the import path the way
``python -m`` does, so a policy file next to the operator (``mypol.py``) would not import; it is
looked up there too, after every installed package, so a local file never shadows one.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from .base import Policy, PolicySpec
from .exceptions import PolicyError, PolicyLoadError

__all__ = ["load_factory", "import_policy_module", "call_with_arguments", "wrap_policy_object"]


def _missing_module_hint(module_name: str, exc: ModuleNotFoundError) -> str:
    top = module_name.partition(".")[0]
    missing = exc.name or ""
    if missing and missing != module_name and not module_name.startswith(missing + "."):
        # the module was found, but something it imports is not installed
        return f"{module_name!r} was found but imports {missing!r}, which is not installed in this environment ({sys.executable})"
    return (f"no module {module_name!r} in the current directory ({os.getcwd()}) or on the import path; "
            f"run chunkline from the folder that holds {top}.py (or the package {top}/), "
            f"or set PYTHONPATH to that folder, or pip install the package that provides it")


def import_policy_module(module_name: str) -> Any:
    """Import ``module_name``, also from the current directory.

    Raises:
        PolicyLoadError: the module (or something it imports) cannot be imported; the message says
            which, and what to set.
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # last: installed packages win over a same-named local file
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise PolicyLoadError(f"cannot import {module_name!r}: {_missing_module_hint(module_name, exc)}") from exc
    except Exception as exc:  # a policy module may raise anything at import; name it
        raise PolicyLoadError(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature
        return None


def call_with_arguments(fn: Callable[..., Any], what: str, args: Mapping[str, Any], device: str) -> Any:
    """``fn(**args)``, plus ``device=`` when ``fn`` takes it and ``args`` does not set it.

    Raises:
        PolicyLoadError: ``fn`` does not take one of ``args`` (the message lists what it takes),
            or it raised.
    """
    params = _parameters(fn)
    kwargs = dict(args)
    if params is not None:
        takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
        named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = sorted(k for k in kwargs if k not in named and not takes_any)
        if unknown:
            raise PolicyLoadError(f"{what} takes no argument {', '.join(map(repr, unknown))}; it takes: {', '.join(named) or 'none'}")
        if "device" not in kwargs and (takes_any or "device" in named):
            kwargs["device"] = device
    try:
        return fn(**kwargs)
    except PolicyError:
        raise
    except Exception as exc:  # a third-party factory may raise anything; name it
        raise PolicyLoadError(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def _nest(obj: Any, spec_doc: Mapping[str, Any] | None) -> bool:
    """Whether ``infer`` wants nested maps: as configured, else as the object says, else as its
    example observation is laid out (DROID's flat ``observation/...`` names stay flat)."""
    if spec_doc and "nest" in spec_doc:
        return bool(spec_doc["nest"])
    if hasattr(obj, "chunkline_nest"):
        return bool(obj.chunkline_nest)
    example = getattr(obj, "example", None)
    return isinstance(example, Mapping) and any(isinstance(v, Mapping) for v in example.values())


def wrap_policy_object(obj: Any, what: str, spec_doc: Mapping[str, Any] | None = None, args: Mapping[str, Any] | None = None) -> Policy:
    """A :class:`Policy` as is; an openpi-style object (``infer(obs) -> dict``) wrapped in
    :class:`~chunkline.policies.openpi_adapter.OpenPIPolicy`, its spec from ``spec_doc`` (the
    server TOML's ``[policies.spec]``, gaps filled from the object's ``example`` observation, see
    :mod:`~chunkline.policies.spec_doc`), else from its ``chunkline_spec`` attribute.

    Raises:
        PolicyLoadError: neither kind, or an openpi object whose spec cannot be found.
    """
    if isinstance(obj, Policy):
        if spec_doc:
            raise PolicyLoadError(f"{what} is a Policy with its own spec; a spec in the configuration is for openpi-style objects only")
        return obj
    if not callable(getattr(obj, "infer", None)):
        raise PolicyLoadError(f"{what} returned {type(obj).__name__}: neither a Policy nor an object with infer()")
    from .openpi_adapter import OpenPIPolicy
    from .spec_doc import spec_from_doc

    spec = spec_from_doc(spec_doc, getattr(obj, "example", None), obj.infer) if spec_doc else getattr(obj, "chunkline_spec", None)
    if not isinstance(spec, PolicySpec):
        raise PolicyLoadError(
            f"{what} returned an openpi-style {type(obj).__name__} without a spec: give one in the server TOML "
            "([policies.spec] with dt, and the fields or an example observation; see docs/policies.md) "
            "or a 'chunkline_spec' attribute")
    return OpenPIPolicy(obj, spec, name=str(getattr(obj, "chunkline_name", "openpi")),
                        digest=getattr(obj, "chunkline_digest", None),
                        nest=_nest(obj, spec_doc),
                        settings={"args": dict(args or {})} if args else None)


def load_factory(ref: str, device: str, args: Mapping[str, Any], spec_doc: Mapping[str, Any] | None = None) -> Policy:
    """Load ``module:factory`` (``factory`` may be dotted: ``module:Class.build``)."""
    module_name, _, attr = ref.partition(":")
    factory: Any = import_policy_module(module_name)
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise PolicyLoadError(f"module {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise PolicyLoadError(f"{ref!r} is not callable")
    return wrap_policy_object(call_with_arguments(factory, f"factory {ref!r}", args, device), repr(ref), spec_doc, args)
