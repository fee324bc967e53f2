"""The docs cover what the code accepts and cite only files the repository has."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkline.bench.cli import SUITES
from chunkline.server.core.tenants.schema import KeyEntry, LimitsConfig, TenantConfig, TenantsFile

ROOT = Path(__file__).resolve().parents[1]


def _documented_keys() -> set[str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text[text.index("## The tenants file"):]
    return set(re.findall(r"^\| `([^`]+)` \|", section, flags=re.M))


def test_every_tenants_file_key_is_documented() -> None:
    expected: set[str] = set(TenantsFile.model_fields) - {"tenants"} | {"tenants.<name>"}
    models: list[tuple[str, Any]] = [("", TenantConfig), ("limits.", LimitsConfig), ("keys[].", KeyEntry)]
    for prefix, model in models:
        expected |= {prefix + name for name in model.model_fields if not (prefix == "" and name in ("limits", "keys"))}
    assert expected - _documented_keys() == set()


def test_benchmarks_doc_lists_every_suite_and_cites_no_missing_file() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    missing = [name for name in SUITES if f"`{name}`" not in text]
    assert not missing
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)", doc.read_text()):
            if "://" not in target:
                assert (doc.parent / target).exists(), (doc.name, target)
        assert "DESIGN.md" not in doc.read_text() or doc.name == "architecture.md", doc.name


def _names_in(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module, each with the names defined in its body (methods, fields)."""
    import ast

    names: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            members: set[str] = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
            names[node.name] = members
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = set()
        elif isinstance(node, ast.Assign):
            names.update({t.id: set() for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = set()
    return names


def _resolve(cited: str) -> Path | None:
    """A cited ``path.py``: from the repository's root, else the one file whose path ends so."""
    if (ROOT / cited).is_file():
        return ROOT / cited
    found = [p for top in ("server", "client", "broker", "safety", "policies", "bench") for p in (ROOT / top).rglob("*.py")
             if p.as_posix().endswith("/" + cited)]
    return found[0] if len(found) == 1 else None


def test_every_file_and_symbol_the_architecture_page_names_exists() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    cited = re.findall(r"`([\w/]+\.py): ([A-Za-z_][\w.]*)", text)
    assert cited, "the page names no file: symbol pairs any more"
    missing = []
    for file, symbol in cited:
        path = _resolve(file)
        if path is None:
            missing.append(f"{file} (no such file)")
            continue
        top, *rest = symbol.split(".")
        names = _names_in(path)
        if top not in names or (rest and rest[0] not in names[top]):
            missing.append(f"{file}: {symbol}")
    assert not missing, missing


# ---------------------------------------------------------------- commands a reader would paste

_COMMAND = re.compile(r"^(\.venv/bin/)?(chunkline|make|pip|\.venv/bin/pip|python3?|git|curl) ")
#: placeholders the docs use, and what a test pastes instead
_PLACEHOLDERS = {"ck_...": "ck_test", "<this repository>": "https://example.invalid/chunkline.git",
                 "<main's checkout>": "../main", "<suite>": "load", "...": ""}


def _shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks a reader runs in a shell (``bash``, ``sh``, ``console`` or unmarked)."""
    blocks, body, lang = [], [], None
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                if lang in ("bash", "sh", "console", ""):
                    blocks.append("\n".join(body))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def pasted_commands() -> list[tuple[str, str]]:
    """``(doc, command)`` for every command line in a shell block of README.md and docs/*.md
    (comments and ``\\`` continuations resolved; what is not a command goes in a ``text`` block)."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _shell_blocks(doc.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                if line and not line.startswith("#") and not re.match(r"^chunkline +[\d.]+ ", line):
                    out.append((doc.name, line))
    return out


# How each command a reader would paste is covered: ``run`` names the test that runs it as
# written (placeholders filled in); ``short`` the test that runs it with smaller figures (a
# benchmark as written takes minutes); ``needs`` says what running it as written needs that a
# test machine lacks. Every command has one entry, every entry a command, every test exists.
_GPU = "needs a GPU"
_CLUSTER = "needs a Ray cluster, or minutes of a local one"
_CHECKPOINT = "needs the reader's own checkpoint"
_FRESH = "needs a fresh machine: .ci/run does it on a clean checkout"
_MINUTES = "needs minutes of a quiet machine (a benchmark with no shorter run in the tests)"
_SMOKE = "tests/bench/test_bench_smoke.py"
COVERAGE: tuple[tuple[str, str, str], ...] = (
    ("README.md", r"make demo", "run tests/server/entrypoints/test_cli.py::test_demo_runs_end_to_end_and_exits_zero"),
    ("README.md", r"make (test|test-lerobot|dist)", _FRESH),
    ("README.md", r"git clone .*|python3 -m venv \.venv|\.venv/bin/pip install -e .*", _FRESH),
    ("README.md", r"\.venv/bin/chunkline serve --no-auth --policy loadtest",
     "run tests/test_readme.py::test_the_readme_serves_the_policy_the_robot_example_expects"),
    ("README.md", r"\.venv/bin/chunkline (keys add|serve --tenants|infer) .*", "run tests/test_docs.py::test_the_readme_serve_lines_run"),
    ("README.md", r"\.venv/bin/chunkline top .*", "run tests/bench/test_top.py::test_top_in_tmux_shows_the_metrics_figures"),
    ("README.md", r"(\.venv/bin/chunkline serve .*--http-port|curl ).*", "run tests/test_docs.py::test_the_readme_openai_lines_run"),
    ("README.md", r"\.venv/bin/chunkline cluster .*", _CLUSTER),
    ("cluster.md", r"chunkline cluster up --local .*", "short tests/server/cluster/test_cluster_ray.py::test_robots_spread_over_ray_replicas_and_move_when_one_is_killed"),
    ("cluster.md", r"chunkline cluster up --address auto .*--device cuda.*", _GPU),
    ("cluster.md", r"chunkline cluster (status|status --json|rollout .*|down)", _CLUSTER),
    ("benchmarks.md", r"chunkline bench (<suite> )?--help", "run tests/test_docs.py::test_every_pasted_chunkline_command_is_accepted_by_the_command_line"),
    ("benchmarks.md", r"chunkline bench overhead .*", f"short {_SMOKE}::test_overhead_smoke"),
    ("benchmarks.md", r"chunkline bench span-ab .*", f"short {_SMOKE}::test_span_ab_takes_the_variant_in_one_arm_only"),
    ("benchmarks.md", r"chunkline bench fleet --robots .*", _MINUTES),
    ("benchmarks.md", r"chunkline bench fleet-contention .*",
     "short tests/bench/test_broker_fleet_contention.py::test_des_mode_runs_either_server_strategy_on_the_same_cores"),
    ("benchmarks.md", r"chunkline bench load .*", f"short {_SMOKE}::test_load_smoke_against_a_baseline"),
    ("benchmarks.md", r"chunkline bench retry .*", f"short {_SMOKE}::test_retry_storm_smoke"),
    ("benchmarks.md", r"chunkline bench breakdown .*", f"short {_SMOKE}::test_breakdown_smoke"),
    ("benchmarks.md", r"chunkline capacity .*", f"short {_SMOKE}::test_capacity_smoke"),
    ("benchmarks.md", r"chunkline bench admission .*", f"short {_SMOKE}::test_admission_smoke_against_a_baseline"),
    ("benchmarks.md", r"chunkline bench broker .*", "short tests/bench/test_broker_bench.py::test_the_cli_compares_in_one_run"),
    ("benchmarks.md", r"chunkline bench closed-loop .*", "short tests/bench/test_closedloop_rtc.py::test_the_targets_are_checked_per_task_and_horizon"),
    ("benchmarks.md", r"chunkline bench link .*", "short tests/bench/test_link_server.py::test_adaptive_on_loopback_measures_then_sends_raw"),
    ("benchmarks.md", r"chunkline bench startup --model act-real .*", f"short {_SMOKE}::test_startup_smoke"),
    ("benchmarks.md", r"chunkline bench text", _MINUTES),
    ("benchmarks.md|operations.md", r"chunkline bench soak.*", "short tests/bench/test_soak.py::test_soak"),
    ("benchmarks.md", r"chunkline bench cluster .*", _CLUSTER),
    ("benchmarks.md|operations.md", r"chunkline bench fuzz.*", "short tests/live/test_fuzz_protocol.py::test_the_seed_frames_on_the_live_server"),
    ("operations.md", r"(cd docs/prometheus && )?promtool (check|test) rules .*",
     "run tests/live/test_prometheus.py::test_promtool_unit_tests_of_every_alert_pass"),
    ("planner.md", r"chunkline serve .*--planner tour", "run tests/test_docs.py::test_the_planner_page_serves_and_plans_as_written"),
    ("policies.md", r"chunkline serve --no-auth --policy (mypol:make|lerobot:/models/).*", _CHECKPOINT),
    ("policies.md", r"chunkline serve --no-auth --policy reach-flow-jax", "run tests/test_docs.py::test_the_policies_page_serves_reach_flow_jax"),
    ("policies.md", r"python -m chunkline\.bench\.closedloop\.train_flow .*",
     "short tests/policies/test_rtc_flow.py::test_the_training_driver_evaluates_a_policy_in_closed_loop"),
)


def _test_exists(reference: str) -> bool:
    path, _, name = reference.partition("::")
    return (ROOT / path).is_file() and name in _names_in(ROOT / path)


def test_every_pasted_command_is_run_by_a_test_or_marked_with_what_it_needs() -> None:
    commands = pasted_commands()
    uncovered = [f"{doc}: {c}" for doc, c in commands
                 if not any(re.fullmatch(docs, doc) and re.fullmatch(pattern, c) for docs, pattern, _ in COVERAGE)]
    assert not uncovered, f"add each to COVERAGE: the test that runs it, or what it needs: {uncovered}"
    unused = [pattern for docs, pattern, _ in COVERAGE
              if not any(re.fullmatch(docs, doc) and re.fullmatch(pattern, c) for doc, c in commands)]
    assert not unused, f"COVERAGE entries no doc command matches any more: {unused}"
    missing = [how for _, _, how in COVERAGE if how.startswith(("run ", "short ")) and not _test_exists(how.split(" ", 1)[1])]
    assert not missing, missing
    assert {how.split(" ", 1)[0] for _, _, how in COVERAGE} == {"run", "short", "needs"}


def _argv(command: str) -> list[str]:
    for k, v in _PLACEHOLDERS.items():
        command = command.replace(k, v)
    words = shlex.split(command.split("&&")[0])
    return [w for w in words[1:] if not (w.startswith("[") and w.endswith("]"))]


class _Parsed(BaseException):
    """A suite's flags parsed: stop before it runs."""


def _parse_strictly(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
    _, extras = self.parse_known_args(args, namespace)
    if extras:
        self.error(f"unrecognized arguments: {' '.join(extras)}")
    raise _Parsed


def _synopsis_argv(command: str) -> list[str]:
    """A usage line as arguments: every ``[optional]`` part in, the first of ``a|b`` alternatives."""
    for k, v in _PLACEHOLDERS.items():
        command = command.replace(k, v)
    words = shlex.split(command.split("&&")[0].replace("[", " ").replace("]", " "))
    return [w.split("|")[0] for w in words[1:]]


def _parse_problem(command: str, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Why ``command`` (a `chunkline` line) does not parse, or ``None``: its subcommands, flags
    and choices exist, a benchmark's flags by the suite's own parser (stopped once parsed)."""
    from chunkline.bench.cli import SUITES
    from chunkline.server.entrypoints.cli import build_parser

    argv = [w for w in _synopsis_argv(command.removeprefix("OMP_NUM_THREADS=1 ")) if w != "--help"]
    suite = argv[1] if argv[0] == "bench" and len(argv) > 1 else None
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            if "--help" in command or (suite is None and argv[0] == "bench"):
                build_parser().parse_args(argv + ["--help"])  # prints help, touches nothing
            else:
                build_parser().parse_args(argv)
            if suite is not None and "--help" not in command:
                with monkeypatch.context() as patch:
                    patch.setattr(argparse.ArgumentParser, "parse_args", _parse_strictly)
                    importlib.import_module(SUITES[suite][0]).main(argv[2:])
                return "the suite ran instead of parsing its flags"
    except _Parsed:
        pass
    except SystemExit as exc:
        if exc.code != 0:
            return (err.getvalue().strip().splitlines() or [str(exc.code)])[-1]
    return None


def test_every_pasted_chunkline_command_is_accepted_by_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """What each then does is covered as COVERAGE below says."""
    commands = [(doc, c) for doc, c in pasted_commands() if re.match(r"^(\.venv/bin/)?chunkline ", c)]
    assert len(commands) > 40
    bad = {f"{doc}: {c}": problem for doc, c in commands if (problem := _parse_problem(c.removeprefix(".venv/bin/"), monkeypatch))}
    assert not bad, bad


def test_every_chunkline_command_quoted_in_the_text_with_flags_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands in the docs' sentences and tables (`chunkline bench load --rates ...`): the
    ones with flags are the ones a reader copies to reproduce a figure."""
    quoted = {(doc.name, c) for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
              for c in re.findall(r"`((?:OMP_NUM_THREADS=1 )?chunkline [^`]*--[^`]*)`", doc.read_text())}
    assert len(quoted) > 15
    bad = {f"{doc}: {c}": problem for doc, c in sorted(quoted) if (problem := _parse_problem(c, monkeypatch))}
    assert not bad, bad


def test_every_documented_pip_extra_and_make_target_exists() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = set(re.findall(r"^(\w+) = \[", pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0], re.M))
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    for doc, command in pasted_commands():
        for group in re.findall(r"\[([\w,]+)\]", command):
            assert set(group.split(",")) <= extras, (doc, command)
        if command.startswith("make "):
            assert _argv(command)[0] in targets, (doc, command)
        if re.match(r"^python3? -m chunkline\.", command):
            module = _argv(command)[1]
            assert importlib.util.find_spec(module) is not None, (doc, command)
        if "pip install" in command and "chunkline[" in command:
            raise AssertionError(f"{doc}: {command}: chunkline is not on PyPI; install from a checkout (-e '.[...]')")
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:  # in sentences too
        for line in doc.read_text().splitlines():
            assert not re.search(r"pip install[^`\n]*chunkline\[", line), f"{doc.name}: {line}: chunkline is not on PyPI"


def _block_after(doc: str, marker: str) -> str:
    text = (ROOT / "docs" / doc).read_text()
    start = text.index(marker)
    return text[text.rindex("```python\n", 0, start) + len("```python\n"): text.index("```", start)]


def test_the_numpy_policy_of_policies_md_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkline.policies import example_observation, load_policy, stack_observations

    source = _block_after("policies.md", "# numpol.py")
    assert len(source.strip().splitlines()) <= 15
    (tmp_path / "numpol.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    policy = load_policy("numpol:make", args={"gain": 0.5})
    policy.warmup()
    actions = policy.infer_batch(stack_observations(policy.spec, [example_observation(policy.spec)] * 2))
    assert actions.shape == (2, 10, 7) and policy.fingerprint.startswith("sha256:")
    assert load_policy("numpol:make", args={"gain": 0.25}).fingerprint != policy.fingerprint


def test_the_numpy_policy_is_served_under_its_own_name_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkline.bench.serverproc import ServerProcess
    from chunkline.client import Client, ErrorCode, ServerError
    from chunkline.policies import example_observation, load_policy

    source = _block_after("policies.md", "# numpol.py")
    serve = source.splitlines()[0].split("--", 1)[1].strip()  # the serve line in the file's first comment
    (tmp_path / "numpol.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    obs = example_observation(load_policy("numpol:make").spec)
    with ServerProcess(_argv(serve)[1:]) as server, Client.connect(server.uri) as client:
        assert client.hello.default_model == "numpol:make"
        assert client.hello.models["numpy-arm"] == client.hello.models["numpol:make"]
        by_own = client.infer(obs, model="numpy-arm", deadline_ms=5000)
        by_ref = client.infer(obs, model="numpol:make", deadline_ms=5000)
        assert by_own.fingerprint == by_ref.fingerprint and by_own.actions.shape == (10, 7)
        with pytest.raises(ServerError) as err:
            client.infer(obs, model="numpy", deadline_ms=5000)
        assert err.value.code == ErrorCode.UNKNOWN_MODEL


def test_the_planner_page_serves_and_plans_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkline.bench.serverproc import ServerProcess

    serve = next(c for doc, c in pasted_commands() if doc == "planner.md" and c.startswith("chunkline serve"))
    argv = _argv(serve)[1:]  # the serve flags; ServerProcess adds its port
    source = _block_after("planner.md", "client = Client.connect()")
    with ServerProcess(argv) as server:
        monkeypatch.setenv("CHUNKLINE_URI", server.uri)
        namespace: dict[str, Any] = {}
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(source, "planner.md", "exec"), namespace)  # the page's own code
        namespace["client"].close()
        log = server.log_path.read_text()
    assert [s["target"] for s in namespace["reply"].plan["steps"]] == ["t3", "t7"], out.getvalue()
    assert "planner 'tour': backend embedded" in log  # what --planner NAME serves is on the console


def test_the_policies_page_serves_reach_flow_jax() -> None:
    from chunkline.bench.serverproc import ServerProcess
    from chunkline.client import Client
    from chunkline.server.entrypoints.cli import example_from_wire_spec

    pytest.importorskip("jax")
    serve = next(c for doc, c in pasted_commands() if doc == "policies.md" and "reach-flow-jax" in c)
    with ServerProcess(_argv(serve)[1:]) as server, Client.connect(server.uri) as client:
        assert client.hello is not None and list(client.hello.models) == ["reach-flow-jax"]
        obs = example_from_wire_spec(client.hello.models["reach-flow-jax"], np.random.default_rng(0))
        reply = client.infer(obs, obs_time=0.0)
    assert reply.actions.ndim == 2 and np.isfinite(reply.actions).all()


def test_the_readme_serve_lines_run(tmp_path: Path) -> None:
    """README's Serve block: a key made, a server on it, one request with the key (the
    no-auth line is the README robot example's, tests/test_readme.py)."""
    from chunkline.bench.serverproc import ServerProcess
    from chunkline.server.entrypoints.cli import main

    lines = [c.removeprefix(".venv/bin/") for doc, c in pasted_commands() if doc == "README.md"]
    keys = _argv(next(c for c in lines if c.startswith("chunkline keys add")))
    tenants = tmp_path / "tenants.toml"
    keys[keys.index("tenants.toml")] = str(tenants)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(keys) == 0
    key = re.search(r"^key: +(ck_\S+)", out.getvalue(), re.M)
    assert key is not None, out.getvalue()
    serve = _argv(next(c for c in lines if c.startswith("chunkline serve --tenants")))[1:]
    serve[serve.index("tenants.toml")] = str(tenants)
    serve[serve.index("--metrics-port") + 1] = "0"
    with ServerProcess(serve) as server:
        infer = _argv(next(c for c in lines if c.startswith("chunkline infer")))
        infer[infer.index("--uri") + 1], infer[infer.index("--api-key") + 1] = server.uri, key.group(1)
        done = subprocess.run([sys.executable, "-m", "chunkline.server", *infer], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "actions_shape" in done.stdout, done.stderr


def test_the_readme_openai_lines_run() -> None:
    import json
    import urllib.request

    from chunkline.bench.serverproc import ServerProcess

    lines = [c.removeprefix(".venv/bin/") for doc, c in pasted_commands() if doc == "README.md"]
    serve = _argv(next(c for c in lines if "--http-port" in c))[1:]
    serve[serve.index("--http-port") + 1] = "0"
    curl = _argv(next(c for c in lines if c.startswith("curl ")))
    body = curl[curl.index("-d") + 1]
    with ServerProcess(serve) as server:
        url = curl[1].replace("8001", str(server.http_port))
        request = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            reply = json.loads(response.read())
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] <= 8
