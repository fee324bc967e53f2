"""The HTTP API's published OpenAPI document against a live ``chunkline serve``: schemathesis
generates requests from ``/openapi.json`` (valid and not) with a tenant's key and checks every
answer: no unexplained server error (500/502, or a 5xx without one of the documented admission
codes), and every status, content type and JSON body as the document says."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from tenants_files import TenantsFile

from chunkline.bench.serverproc import ServerProcess, http_get

# 5xx answers the document lists, each with its code: admission refusing or dropping work.
ADMISSION_CODES = {"overloaded", "deadline_unmeetable", "not_ready", "shutting_down", "deadline_exceeded"}
EXAMPLES = 25  # per operation: the whole run stays well under 30 s on a 2-core machine


@pytest.fixture(scope="module")
def served(tenants_file: TenantsFile) -> Iterator[tuple[ServerProcess, str]]:
    tenants, keys = tenants_file(keys=["alice"])
    key = keys["alice"]
    with ServerProcess(["--policy", "noop", "--tenants", str(tenants), "--text-model", "tiny", "--http-port", "0"]) as server:
        yield server, key


def no_unexplained_server_error(ctx: Any, response: Any, case: Any) -> None:
    """A 5xx is fine only as a documented admission refusal (its code in the body)."""
    if response.status_code < 500:
        return
    try:
        code = response.json()["error"]["code"]
    except Exception:  # not our error body at all
        code = None
    if response.status_code in (500, 502) or code not in ADMISSION_CODES:
        raise AssertionError(f"server error {response.status_code} {code!r}: {response.text[:200]}")


def _served_model(drawn: tuple[Any, bool]) -> Any:
    """Half the bodies name the served model (random names are all 404) without a deadline (a
    random one is often unmeetable: 503), so that completions are answered too."""
    case, use_served = drawn
    if use_served and isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "tiny"
        case.body.pop("deadline_ms", None)
        if case.headers:
            case.headers.pop("X-Chunkline-Deadline-Ms", None)
    return case


def test_the_schema_is_served_without_a_key_and_names_every_route(served: tuple[ServerProcess, str]) -> None:
    server, _ = served
    status, body = http_get("127.0.0.1", server.http_port, "/openapi.json")
    assert status == 200
    doc = json.loads(body)
    assert doc["openapi"].startswith("3.") and set(doc["paths"]) == {
        "/healthz", "/readyz", "/v1/models", "/v1/models/{model}", "/v1/chat/completions", "/v1/completions"}


def test_every_answer_matches_the_published_schema(served: tuple[ServerProcess, str]) -> None:
    server, key = served
    base = f"http://127.0.0.1:{server.http_port}"
    api = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) == 6
    checks = [no_unexplained_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    seen: dict[str, set[int]] = {}
    for operation in operations:

        @given(case=st.tuples(operation.as_strategy(), st.booleans()).map(_served_model))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
        def call(case: Any) -> None:
            response = case.call_and_validate(base_url=base, headers={"Authorization": f"Bearer {key}"}, checks=checks, timeout=30)
            seen.setdefault(case.operation.label, set()).add(response.status_code)

        call()
    # Not vacuous: completions were generated and refused alike.
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert {200, 400} <= seen[label], (label, seen[label])
