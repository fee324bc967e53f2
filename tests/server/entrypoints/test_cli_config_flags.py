"""``serve --config FILE`` with flags: every flag that has a file key replaces the file's value
(docs/configuration.md), ``--no-auth`` and ``--tenants`` included; nested typos get a suggestion."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tenants_files import write_tenants

from chunkline.server.entrypoints.cli import build_parser
from chunkline.server.entrypoints.cli_errors import UsageError
from chunkline.server.entrypoints.server_flags import server_config_from_args


def _config(tmp_path: Path, body: str, *flags: str) -> Any:
    path = tmp_path / "c.toml"
    path.write_text(body)
    return server_config_from_args(build_parser().parse_args(["serve", "--config", str(path), *flags]))


def _tenants(tmp_path: Path) -> Path:
    return write_tenants(tmp_path, {"acme": {}})[0]


POLICY = '[[policies]]\nref = "noop"\n'

#: (flag and value, the file's key and its other value, what the configuration then holds)
CASES: list[tuple[list[str], str, Callable[[Any], Any], Any]] = [
    (["--host", "0.0.0.0"], 'host = "127.0.0.2"', lambda c: c.host, "0.0.0.0"),
    (["--port", "9001"], "port = 9000", lambda c: c.port, 9001),
    (["--port-file", "b.port"], 'port_file = "a.port"', lambda c: c.port_file, Path("b.port")),
    (["--max-message-bytes", "4096"], "max_message_bytes = 2048", lambda c: c.max_message_bytes, 4096),
    (["--max-receive-buffer-bytes", "8192"], "max_receive_buffer_bytes = 4096", lambda c: c.max_receive_buffer_bytes, 8192),
    (["--tenant-receive-buffer-share", "0.25"], "tenant_receive_buffer_share = 0.75", lambda c: c.tenant_receive_buffer_share, 0.25),
    (["--shutdown-grace", "3"], "shutdown_grace_s = 7", lambda c: c.shutdown_grace_s, 3.0),
    (["--ledger", "b.db"], 'ledger = "a.db"', lambda c: c.ledger, Path("b.db")),
    (["--no-ledger"], 'ledger = "a.db"', lambda c: c.ledger, None),
    (["--metrics-port", "9101"], "metrics_port = 9100", lambda c: c.metrics_port, 9101),
    (["--max-connections-per-address", "5"], "max_connections_per_address = 9", lambda c: c.max_connections_per_address, 5),
    (["--send-timeout", "2"], "send_timeout_s = 4", lambda c: c.send_timeout_s, 2.0),
    (["--http-port", "8081"], "http_port = 8080", lambda c: c.http_port, 8081),
    (["--text-model", "b"], '[[text]]\nname = "a"', lambda c: [t.name for t in c.text], ["b"]),
    (["--planner", "b"], '[[planners]]\nname = "a"', lambda c: [p.name for p in c.planners], ["b"]),
    (["--policy", "loadtest", "--name", "lt"], "", lambda c: [(p.ref, p.model_name) for p in c.policies], [("loadtest", "lt")]),
    (["--device", "cuda:1"], 'device = "cpu"', lambda c: c.policies[0].device, "cuda:1"),
    (["--backend", "jax"], 'backend = "numpy"', lambda c: c.policies[0].backend, "jax"),
    (["--max-batch-size", "3"], "max_batch_size = 8", lambda c: c.policies[0].max_batch_size, 3),
    (["--max-batch-wait-ms", "1.5"], "max_batch_wait_ms = 4", lambda c: c.policies[0].max_batch_wait_ms, 1.5),
    (["--lanes", "2"], "lanes = 3", lambda c: c.policies[0].lanes, 2),
    (["--no-background-timing"], "background_timing = true", lambda c: c.policies[0].background_timing, False),
    (["--hang-timeout", "5"], "hang_timeout_s = 9", lambda c: c.policies[0].hang_timeout_s, 5.0),
]
_POLICY_KEYS = {"device", "backend", "max_batch_size", "max_batch_wait_ms", "lanes", "background_timing",
                "hang_timeout_s"}


@pytest.mark.parametrize(("flags", "key", "read", "expected"), CASES, ids=[c[0][0] for c in CASES])
def test_a_flag_replaces_the_files_key(tmp_path: Path, flags: list[str], key: str, read: Callable[[Any], Any],
                                       expected: Any) -> None:
    is_policy_key = key.split(" ", 1)[0] in _POLICY_KEYS
    body = f"no_auth = true\n{POLICY}{key}\n" if is_policy_key else f"no_auth = true\n{key}\n{POLICY}"
    assert read(_config(tmp_path, body)) != expected, "the file alone says otherwise"
    assert read(_config(tmp_path, body, *flags)) == expected


def test_no_auth_on_the_command_line_needs_nothing_in_the_file(tmp_path: Path) -> None:
    assert _config(tmp_path, POLICY, "--no-auth").no_auth


def test_no_auth_on_the_command_line_replaces_the_files_tenants(tmp_path: Path) -> None:
    config = _config(tmp_path, f'tenants = "{_tenants(tmp_path)}"\n{POLICY}', "--no-auth")
    assert config.no_auth and config.tenants is None


def test_tenants_on_the_command_line_replace_the_files_no_auth(tmp_path: Path) -> None:
    tenants = _tenants(tmp_path)
    config = _config(tmp_path, f"no_auth = true\n{POLICY}", "--tenants", str(tenants))
    assert config.tenants == tenants and not config.no_auth


def test_tls_flags_replace_the_files_pair(tmp_path: Path) -> None:
    body = f'no_auth = true\ntls_cert = "a.pem"\ntls_key = "a.key"\n{POLICY}'
    config = _config(tmp_path, body, "--tls-cert", "b.pem", "--tls-key", "b.key")
    assert (config.tls_cert, config.tls_key) == (Path("b.pem"), Path("b.key"))


def test_the_files_policy_settings_stay_when_no_flag_touches_them(tmp_path: Path) -> None:
    config = _config(tmp_path, f"no_auth = true\n{POLICY}max_batch_size = 8\nlanes = 2\n", "--device", "cuda:0")
    assert (config.policies[0].max_batch_size, config.policies[0].lanes, config.policies[0].device) == (8, 2, "cuda:0")


def test_a_flag_out_of_range_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"policies\.0\.lanes"):
        _config(tmp_path, f"no_auth = true\n{POLICY}", "--lanes", "0")


def test_a_nested_typo_gets_did_you_mean(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"unknown setting 'policies\.0\.max_batch' \(did you mean 'max_batch_size'\?\)"):
        _config(tmp_path, f"no_auth = true\n{POLICY}max_batch = 4\n")
    with pytest.raises(UsageError, match=r"unknown setting 'prot' \(did you mean 'port'\?\)"):
        _config(tmp_path, f"no_auth = true\nprot = 1\n{POLICY}")


def test_a_file_that_settles_no_authentication_says_which_flags_would(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as info:
        _config(tmp_path, POLICY)
    assert info.value.problem.endswith("with the flags: give a tenants file (--tenants) or, for local use only, --no-auth")
