"""Every expected failure of the `chunkline` command is one line on stderr and exit status 2;
`--debug` shows the traceback instead."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from chunkline.bench.serverproc import ServerProcess
from chunkline.server.entrypoints.cli_errors import UsageError

pytestmark = pytest.mark.live  # its tests start servers or proxies on loopback


def _chunkline(*args: str, cwd: Path | None = None, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chunkline.server", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


def _assert_one_line(out: subprocess.CompletedProcess[str], *words: str) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.fixture()
def busy_port() -> Iterator[int]:
    """A port something already listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_missing_tenants_file(tmp_path: Path) -> None:
    out = _chunkline("serve", "--tenants", "missing.toml", "--port", "0", cwd=tmp_path)
    _assert_one_line(out, "missing.toml", "cannot read", "keys add")


def test_invalid_tenants_file(tmp_path: Path) -> None:
    (tmp_path / "tenants.toml").write_text("[tenants.acme\nkeys = 3\n")
    _assert_one_line(_chunkline("serve", "--tenants", "tenants.toml", "--port", "0", cwd=tmp_path), "tenants.toml", "cannot parse")
    (tmp_path / "tenants.toml").write_text("[tenants.acme]\nrate_hz = 'fast'\n")
    _assert_one_line(_chunkline("serve", "--tenants", "tenants.toml", "--port", "0", cwd=tmp_path), "tenants.toml")


def test_config_file_missing_or_with_a_typo(tmp_path: Path) -> None:
    _assert_one_line(_chunkline("serve", "--config", "nope.toml", "--no-auth", cwd=tmp_path), "nope.toml", "--config")
    (tmp_path / "server.toml").write_text("no_auth = true\nprot = 8001\n")
    line = _assert_one_line(_chunkline("serve", "--config", "server.toml", cwd=tmp_path), "'prot'", "did you mean 'port'")
    assert "pydantic" not in line


def test_wrong_policy_name(tmp_path: Path) -> None:
    out = _chunkline("serve", "--no-auth", "--no-ledger", "--policy", "loadtst", "--port", "0", cwd=tmp_path)
    _assert_one_line(out, "unknown policy 'loadtst'", "loadtest", "--policy")


def test_serve_on_a_busy_port(tmp_path: Path, busy_port: int) -> None:
    out = _chunkline("serve", "--no-auth", "--no-ledger", "--policy", "noop", "--port", str(busy_port), cwd=tmp_path)
    _assert_one_line(out, f"port {busy_port} is already in use", "--port")


def test_cluster_up_on_a_busy_port(tmp_path: Path, busy_port: int) -> None:
    pytest.importorskip("ray")
    out = _chunkline("cluster", "up", "--local", "--no-auth", "--no-ledger", "--policy", "noop", "--directory-port", str(busy_port),
                     cwd=tmp_path)
    _assert_one_line(out, f"port {busy_port} is already in use", "--directory-port")


def test_top_once_against_a_stopped_server() -> None:
    out = _chunkline("top", "--once", "--url", f"http://127.0.0.1:{_free_port()}/metrics")
    _assert_one_line(out, "cannot read", "--url")


class _Refuses(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(401)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_top_once_on_a_401() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuses)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out = _chunkline("top", "--once", "--url", f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    _assert_one_line(out, "HTTP 401", "--metrics-port")


def test_infer_into_a_closed_pipe(noop_server: ServerProcess) -> None:
    """`chunkline infer | head` where head exits first: no BrokenPipe traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        out = subprocess.run([sys.executable, "-m", "chunkline.server", "infer", "--uri", noop_server.uri],
                             stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "broken pipe" in lines[0], out.stderr


def test_infer_against_a_stopped_server() -> None:
    out = _chunkline("infer", "--uri", f"ws://127.0.0.1:{_free_port()}", "--connect-timeout", "1")
    _assert_one_line(out, "could not connect", "--uri")


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    for argv in (["--debug", "serve", "--tenants", "missing.toml"], ["serve", "--tenants", "missing.toml", "--debug"]):
        out = _chunkline(*argv, cwd=tmp_path)
        assert out.returncode != 0 and "Traceback (most recent call last)" in out.stderr, out.stderr
        assert "missing.toml" in out.stderr


def test_every_flag_has_help_and_no_help_screen_shows_markup() -> None:
    """Every option of every `chunkline` subcommand (and of every bench suite) says what it does,
    in plain text."""
    import argparse
    import importlib
    import re

    from chunkline.bench.cli import SUITES
    from chunkline.server.entrypoints.cli import _parsers, build_parser

    markup = re.compile(r"``|:(mod|class|func|meth|attr):`|\*\*")
    screens: dict[str, argparse.ArgumentParser] = {p.prog: p for p in _parsers(build_parser())}
    for name, (module, _) in SUITES.items():
        build = getattr(importlib.import_module(module), "build_parser", None)
        if build is not None:
            screens[f"bench {name}"] = build()
    undocumented = [(prog, a.option_strings) for prog, p in screens.items() for a in p._actions
                    if a.option_strings and a.help is None]
    assert not undocumented
    marked = [(prog, line) for prog, p in screens.items() for line in p.format_help().splitlines() if markup.search(line)]
    assert not marked


def test_cluster_without_ray_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from chunkline.server.cluster import cli as cluster_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(UsageError, match=r"needs Ray.*pip install -e '\.\[server,cluster\]'"):
        cluster_cli.require_ray()


def test_address_auto_refuses_to_guess_between_two_ray_clusters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkline.server.cluster import cli as cluster_cli

    for pid, port in ((101, 6379), (202, 6380)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"/x/ray/core/src/ray/gcs/gcs_server\0--gcs_server_port=%d\0" % port)
    assert cluster_cli.local_ray_clusters(tmp_path) == ["127.0.0.1:6379", "127.0.0.1:6380"]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(cluster_cli, "local_ray_clusters", lambda: ["127.0.0.1:6379", "127.0.0.1:6380"])
    with pytest.raises(UsageError, match=r"2 Ray clusters run on this machine .*--address HOST:PORT"):
        cluster_cli._resolve_address("auto")
    assert cluster_cli._resolve_address("10.0.0.5:6379") == "10.0.0.5:6379"


def test_a_lerobot_checkpoint_without_torch_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from chunkline.policies.exceptions import PolicyLoadError
    from chunkline.policies.registry import check_reference

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(PolicyLoadError, match=r"needs torch.*'lerobot' extra: pip install -e '\.\[server,lerobot\]'"):
        check_reference(f"lerobot:{tmp_path}")


def test_a_policy_that_fails_to_load_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "chunkline.server", "serve", "--no-auth", "--no-ledger", "--port", "0",
                          "--policy", "fail"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2, out.stderr
    assert errors == ["error: could not start: InjectedPolicyFailure: injected failure; --debug shows the traceback"]
    assert "Traceback" not in out.stderr
    # no signal asked for a drain: the log says the start failed, not that a drain began
    assert "start-up failed: closing the port" in out.stderr and "draining" not in out.stderr


@pytest.mark.parametrize(("flag", "expected"), [("tour", {"name": "tour"}), ("constrained", {"name": "constrained", "backend": "constrained"}),
                                                ("lm=constrained", {"name": "lm", "backend": "constrained"})])
def test_planner_flags_name_a_known_backend(flag: str, expected: dict[str, str]) -> None:
    from chunkline.server.entrypoints.server_flags import planner_from_flag

    assert planner_from_flag(flag) == expected


@pytest.mark.parametrize(("flag", "message"), [("constrianed", r"one typo from the backend 'constrained'"),
                                               ("lm=constrianed", r"no planner backend 'constrianed'; did you mean lm=constrained\?"),
                                               ("lm=upstream", r"upstream planners go in the config file")])
def test_a_planner_typo_is_one_line(flag: str, message: str) -> None:
    from chunkline.server.entrypoints.server_flags import planner_from_flag

    with pytest.raises(UsageError, match=message):
        planner_from_flag(flag)
