"""The docs cover what the code accepts and cite only files the repository has."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    (comments and ``\\`` continuations resolved)."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in _shell_blocks(doc.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                if _COMMAND.match(line) and not re.match(r"^chunkline +[\d.]+ ", line):
                    out.append((doc.name, line))
    return out


def _argv(command: str) -> list[str]:
    for k, v in _PLACEHOLDERS.items():
        command = command.replace(k, v)
    words = shlex.split(command.split("&&")[0])
    return [w for w in words[1:] if not (w.startswith("[") and w.endswith("]"))]


def test_every_pasted_chunkline_command_is_accepted_by_the_command_line() -> None:
    """Each documented `chunkline` line parses (flags, subcommands and choices exist); what it
    would then do needs a GPU, a Ray cluster, a file it names or minutes, so those run elsewhere:
    the serve lines of README.md, the planner and numpy-policy pages below, the rest in their suites."""
    from chunkline.server.entrypoints.cli import build_parser

    commands = [(doc, c) for doc, c in pasted_commands() if re.match(r"^(\.venv/bin/)?chunkline ", c)]
    assert len(commands) > 40
    bad = {}
    for doc, command in commands:
        argv = [w for w in _argv(command) if w != "--help"] + ["--help"]  # parse, print help, touch nothing
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                build_parser().parse_args(argv)
        except SystemExit as exc:
            if exc.code != 0:
                bad[f"{doc}: {command}"] = exc.code
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
    assert [s["target"] for s in namespace["reply"].plan["steps"]] == ["t3", "t7"], out.getvalue()


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
