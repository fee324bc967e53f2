"""Tenants file: validation, in-place TOML editing (comments kept), key management, file modes, the immutable registry."""

from __future__ import annotations

import datetime as dt
import os
import stat
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkline.server.core.tenants import (
    KeyEntry,
    LimitsConfig,
    TenantConfig,
    TenantRegistry,
    TenantsFile,
    TenantsFileError,
    UnknownKey,
    UnknownTenant,
    add_key,
    generate_key,
    hash_key,
    key_id,
    list_keys,
    load_registry,
    read_tenants_file,
    revoke_key,
    write_tenants_file,
)
from chunkline.server.core.tenants import documents as tenants_documents

T0 = dt.datetime(2026, 1, 5, 10, 0, tzinfo=dt.timezone.utc)


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_generated_keys_are_random_prefixed_and_hash_to_sha256() -> None:
    keys = {generate_key() for _ in range(200)}
    assert len(keys) == 200
    for k in keys:
        assert k.startswith("ck_") and len(k) == 3 + 43
        assert key_id(k) == k[:11]
        h = hash_key(k)
        assert h.startswith("sha256:") and len(h) == 7 + 64
        assert k not in h
    with pytest.raises(ValueError):
        key_id("sk-not-ours")


def test_example_file_loads_into_registry(tmp_path: Path) -> None:
    key = generate_key()
    path = _write(
        tmp_path / "tenants.toml",
        f"""
version = 1
[tenants.acme]
weight = 2.0
priority = 1
class_priority = {{ text = -1 }}
reserved_share = 0.25
models = ["pi0", "pi05"]
classes = ["policy", "text"]
default_deadline_ms = 150.0
[tenants.acme.limits]
max_sessions = 4
max_in_flight = 16
rate_per_s = 100.0
text_tokens_per_window = 10000
[[tenants.acme.keys]]
id = "{key_id(key)}"
hash = "{hash_key(key)}"
created = 2026-01-05T10:00:00Z
[tenants.lab]
""",
    )
    reg = load_registry(path)
    assert set(reg.tenants) == {"acme", "lab"} and len(reg) == 2 and "acme" in reg
    acme = reg.get("acme")
    assert acme is not None
    assert acme.weight == 2.0 and acme.reserved_share == 0.25 and acme.default_deadline_ms == 150.0
    assert acme.priority_for("policy") == 1 and acme.priority_for("text") == -1
    assert acme.may_use("pi0", "policy") and not acme.may_use("other", "policy")
    assert acme.limits.burst == 100.0  # default burst: ceil(rate)
    lab = reg.get("lab")
    assert lab is not None and lab.may_use("anything", "text") and lab.limits.max_sessions is None
    assert [k.tenant for k in reg.keys] == ["acme"]
    assert reg.key_active("acme", key_id(key)) and not reg.key_active("lab", key_id(key))
    assert reg.get("nobody") is None


@pytest.mark.parametrize(
    "body, needle",
    [
        ("[tenants.a]\nweigth = 2\n", "weigth"),  # a typo must not silently fall back to a default
        ("[tenants.a.limits]\nburst = 3\n", "burst needs rate_per_s"),
        ("[tenants.a]\nreserved_share = 0.7\n[tenants.b]\nreserved_share = 0.6\n", "reserved_share"),
        ("[tenants.a]\nclasses = ['video']\n", "classes"),
        ('[tenants."bad name"]\n', "tenants"),
        ("[tenants.a]\nweight = 0\n", "weight"),
        ("version = 2\n", "version"),
        ("[tenants.a\n", "cannot parse"),
    ],
)
def test_invalid_files_are_refused_with_the_field_named(tmp_path: Path, body: str, needle: str) -> None:
    path = _write(tmp_path / "t.toml", body)
    with pytest.raises(TenantsFileError) as err:
        read_tenants_file(path)
    assert needle in str(err.value)


def test_duplicate_key_digest_is_refused(tmp_path: Path) -> None:
    h = hash_key(generate_key())
    body = f"""
[[tenants.a.keys]]
id = "ck_aaaaaaaa"
hash = "{h}"
created = 2026-01-01T00:00:00Z
[[tenants.b.keys]]
id = "ck_bbbbbbbb"
hash = "{h}"
created = 2026-01-01T00:00:00Z
"""
    with pytest.raises(TenantsFileError, match="twice"):
        read_tenants_file(_write(tmp_path / "t.toml", body))


def test_missing_file_is_a_tenants_file_error(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="cannot read"):
        load_registry(tmp_path / "absent.toml")


def test_yaml_without_pyyaml_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenants_documents, "_import_yaml", lambda: None)
    with pytest.raises(TenantsFileError, match="PyYAML"):
        read_tenants_file(_write(tmp_path / "t.yaml", "tenants: {}\n"))


def test_yaml_with_pyyaml_round_trips(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "t.yaml"
    key, _ = add_key(path, "acme", create_tenant=True, now=T0)
    assert load_registry(path).keys[0].key_id == key_id(key)


# ----------------------------------------------------------------------------- TOML writer

_names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,10}", fullmatch=True)
_limits = st.builds(
    LimitsConfig,
    max_sessions=st.none() | st.integers(0, 1000),
    max_in_flight=st.none() | st.integers(0, 1000),
    text_tokens_per_window=st.none() | st.integers(1, 10**9),
    text_window_s=st.floats(0.001, 1e6),
)
_keys = st.builds(
    KeyEntry,
    id=st.from_regex(r"ck_[A-Za-z0-9_-]{8}", fullmatch=True),
    hash=st.from_regex(r"sha256:[0-9a-f]{64}", fullmatch=True),
    created=st.datetimes(min_value=dt.datetime(2000, 1, 1), max_value=dt.datetime(2100, 1, 1), timezones=st.just(dt.timezone.utc)),
    revoked=st.booleans(),
)
_tenant = st.builds(
    TenantConfig,
    weight=st.floats(0.01, 1000),
    priority=st.integers(-5, 5),
    models=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3),
    default_deadline_ms=st.none() | st.floats(1, 10_000),
    limits=_limits,
    keys=st.lists(_keys, max_size=3, unique_by=(lambda k: k.id, lambda k: k.hash)),
)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(_names, _tenant, max_size=4))
def test_written_files_read_back_equal(tmp_path_factory: pytest.TempPathFactory, tenants: dict[str, TenantConfig]) -> None:
    ids = [k.id for t in tenants.values() for k in t.keys]
    hashes = [k.hash for t in tenants.values() for k in t.keys]
    if len(set(ids)) != len(ids) or len(set(hashes)) != len(hashes):
        return  # the file model itself refuses duplicates; tested above
    data = TenantsFile(tenants=tenants)
    path = tmp_path_factory.mktemp("rt") / "tenants.toml"
    write_tenants_file(path, data)
    assert read_tenants_file(path) == data


# ----------------------------------------------------------------------------- key management


def test_add_list_revoke_cycle(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    with pytest.raises(TenantsFileError, match="no such file"):
        add_key(path, "acme")
    key, entry = add_key(path, "acme", create_tenant=True, now=T0)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert key not in text and entry.hash in text  # only the digest is stored
    key2, entry2 = add_key(path, "acme", now=T0)
    assert entry2.id != entry.id
    with pytest.raises(UnknownTenant):
        add_key(path, "other")
    listing = list_keys(path)
    assert [(r.tenant, r.id, r.revoked) for r in listing] == [("acme", entry.id, False), ("acme", entry2.id, False)]
    assert listing[0].created == T0

    reg = load_registry(path)
    assert {k.key_id for k in reg.keys} == {entry.id, entry2.id}

    rec = revoke_key(path, entry.id, now=T0)
    assert rec.revoked and rec.revoked_at == T0
    assert revoke_key(path, entry.id).revoked_at == T0  # idempotent: the first date stays
    reg2 = load_registry(path)
    assert [k.key_id for k in reg2.keys] == [entry2.id]
    assert not reg2.key_active("acme", entry.id) and reg2.key_active("acme", entry2.id)
    # the old registry is a value: unchanged by the reload
    assert reg.key_active("acme", entry.id)
    with pytest.raises(UnknownKey):
        revoke_key(path, "ck_nonexist")
    with pytest.raises(UnknownKey):
        revoke_key(path, entry2.id, tenant="someone-else")
    with pytest.raises(UnknownTenant):
        list_keys(path, "nobody")
    # no temp files are left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tenants.toml", "tenants.toml.lock"]
    assert key2 != key


def test_rewrite_is_owner_only_and_keeps_settings(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.toml", "[tenants.acme]\nweight = 3.0\nmodels = ['pi0']\n[tenants.acme.limits]\nrate_per_s = 5.0\nburst = 7\n")
    os.chmod(path, 0o644)  # world-readable digests, as an editor under umask 022 leaves them
    add_key(path, "acme", now=T0)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    cfg = read_tenants_file(path).tenants["acme"]
    assert cfg.weight == 3.0 and cfg.models == ["pi0"] and cfg.limits.burst == 7 and len(cfg.keys) == 1


def test_unwritable_folder_is_a_tenants_file_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TenantsFileError):
        write_tenants_file(blocker / "t.toml", TenantsFile())


def test_concurrent_adds_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    add_key(path, "acme", create_tenant=True)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(5):
                add_key(path, "acme")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(list_keys(path)) == 1 + 4 * 5


def test_anonymous_registry() -> None:
    reg = TenantRegistry.anonymous()
    anon = reg.get("anonymous")
    assert anon is not None and anon.may_use("any", "policy") and anon.may_use("any", "text")
    assert anon.limits.max_in_flight is None and reg.keys == ()


def test_add_key_in_unwritable_folder_is_a_tenants_file_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TenantsFileError):
        add_key(blocker / "t.toml", "acme", create_tenant=True)


# ----------------------------------------------------------------------------- CLI


def _keys_cli(argv: list[str]) -> int:
    from chunkline.server.entrypoints.cli import main

    return main(argv)


def test_keys_cli_add_list_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    path = tmp_path / "tenants.toml"
    assert _keys_cli(["keys", "add", "--tenants", str(path), "acme"]) == 2  # no file, no --create
    assert _keys_cli(["keys", "add", "--tenants", str(path), "acme", "--create", "--json"]) == 0
    added = json.loads(capsys.readouterr().out)
    assert added["key"].startswith("ck_") and added["id"] == key_id(added["key"])
    assert load_registry(path).keys[0].key_id == added["id"]
    assert _keys_cli(["keys", "add", "--tenants", str(path), "other"]) == 2
    capsys.readouterr()
    assert _keys_cli(["keys", "list", "--tenants", str(path)]) == 0
    out = capsys.readouterr().out
    assert added["id"] in out and "active" in out and added["key"] not in out
    assert _keys_cli(["keys", "revoke", "--tenants", str(path), added["id"]]) == 0
    assert _keys_cli(["keys", "revoke", "--tenants", str(path), "ck_missing1"]) == 2
    capsys.readouterr()
    assert _keys_cli(["keys", "list", "--tenants", str(path), "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["revoked"] and listed["revoked_at"]
    assert load_registry(path).keys == ()
    assert _keys_cli(["keys", "list", "--tenants", str(path), "--tenant", "nobody"]) == 2


# ----------------------------------------------------------------------------- in-place edits keep the operator's text

_COMMENTED = f"""\
# Tenants of the staging cluster. Owner: robotics-infra.
# Reload with: kill -HUP $(pidof chunkline)
version = 1

# acme: the pilot customer, two arms
[tenants.acme]
weight = 2.0  # twice the lab's share
models = ["pi0"]  # only the production policy

[tenants.acme.limits]
max_sessions = 4 # one per arm, two spare
# max_in_flight = 8  (off while we measure)

[[tenants.acme.keys]]
id = "ck_aaaaaaaa"  # issued to the acme gateway
hash = "{hash_key("ck_aaaaaaaa" + "x" * 35)}"
created = 2026-01-01T00:00:00Z
revoked = false  # check with acme before revoking

# the lab: internal, best effort
[tenants.lab]
priority = -1 # below customers
# end of file
"""


def _is_subsequence(lines: list[str], of: list[str]) -> bool:
    it = iter(of)
    return all(line in it for line in lines)


def test_add_and_revoke_keep_every_comment_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "tenants.toml", _COMMENTED)
    before = load_registry(path)
    _, acme2 = add_key(path, "acme", now=T0)
    _, lab1 = add_key(path, "lab", now=T0)
    _, new1 = add_key(path, "newco", create_tenant=True, now=T0)
    revoke_key(path, "ck_aaaaaaaa", now=T0)
    text = path.read_text()
    lines = text.splitlines()

    original = _COMMENTED.splitlines()
    changed = 'revoked = false  # check with acme before revoking'
    assert _is_subsequence([line for line in original if line != changed], lines), text
    assert "revoked = true  # check with acme before revoking" in lines  # the value changed, its comment stayed
    # a comment written above a table still sits right above it, not above the key appended before it
    assert lines[lines.index("[tenants.lab]") - 1] == "# the lab: internal, best effort"
    assert lines.index(f'id = "{acme2.id}"') < lines.index("# the lab: internal, best effort")
    # a comment under a table's last line stays with that table
    assert lines[lines.index("max_sessions = 4 # one per arm, two spare") + 1] == "# max_in_flight = 8  (off while we measure)"
    # the file's last comment stays last; each new key sits in its own tenant
    assert lines.index(f'id = "{lab1.id}"') > lines.index("[tenants.lab]")
    assert lines.index(f'id = "{new1.id}"') > lines.index(f'id = "{lab1.id}"')

    after = load_registry(path)
    assert after.tenants["acme"] == before.tenants["acme"] and after.tenants["lab"] == before.tenants["lab"]
    assert [(k.tenant, k.key_id) for k in after.keys] == [("acme", acme2.id), ("lab", lab1.id), ("newco", new1.id)]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_inline_tables_are_edited_inline(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.toml", "tenants = { a = { weight = 2.0 }, b = { keys = [] } }  # compact\n")
    _, a = add_key(path, "a", now=T0)
    _, b = add_key(path, "b", now=T0)
    _, c = add_key(path, "c", create_tenant=True, now=T0)
    revoke_key(path, a.id, now=T0)
    assert "# compact" in path.read_text()
    data = read_tenants_file(path)
    assert data.tenants["a"].weight == 2.0 and data.tenants["a"].keys[0].revoked
    assert [k.id for k in data.tenants["b"].keys] == [b.id] and [k.id for k in data.tenants["c"].keys] == [c.id]


def test_an_edit_that_does_not_read_back_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "t.toml", "[tenants.acme]\n")
    monkeypatch.setattr(tenants_documents._TomlDocument, "add_key", lambda self, tenant, entry: None)
    with pytest.raises(TenantsFileError, match="does not read back"):
        add_key(path, "acme", now=T0)
    assert path.read_text() == "[tenants.acme]\n"


_limits_any = st.builds(
    LimitsConfig,
    max_sessions=st.none() | st.integers(0, 1000),
    max_in_flight=st.none() | st.integers(0, 1000),
    rate_per_s=st.none() | st.floats(0.001, 1e6),
    text_tokens_per_window=st.none() | st.integers(1, 10**9),
    text_window_s=st.floats(0.001, 1e6),
)


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(_names, st.builds(TenantConfig, weight=st.floats(0.01, 1000), limits=_limits_any), min_size=1, max_size=4),
    st.data(),
)
def test_names_and_limits_survive_add_and_revoke(tmp_path_factory: pytest.TempPathFactory, tenants: dict[str, TenantConfig], data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("edit") / "tenants.toml"
    write_tenants_file(path, TenantsFile(tenants=tenants))
    tenant = data.draw(st.sampled_from(sorted(tenants)))
    _, entry = add_key(path, tenant, now=T0)
    expected = TenantsFile(tenants={name: cfg.model_copy(update={"keys": [entry]}) if name == tenant else cfg for name, cfg in tenants.items()})
    assert read_tenants_file(path) == expected
    revoke_key(path, entry.id, now=T0)
    revoked = entry.model_copy(update={"revoked": True, "revoked_at": T0})
    expected.tenants[tenant] = expected.tenants[tenant].model_copy(update={"keys": [revoked]})
    assert read_tenants_file(path) == expected
    assert load_registry(path).tenants == TenantRegistry.from_file(expected).tenants


# ----------------------------------------------------------------------------- owner-only files


@pytest.fixture()
def permissive_umask() -> object:
    old = os.umask(0)  # the modes must not depend on the caller's umask
    try:
        yield None
    finally:
        os.umask(old)


@pytest.mark.usefixtures("permissive_umask")
def test_files_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    toml_path = tmp_path / "t.toml"
    add_key(toml_path, "acme", create_tenant=True, now=T0)
    write_tenants_file(tmp_path / "w.toml", TenantsFile())
    for p in (toml_path, tmp_path / "t.toml.lock", tmp_path / "w.toml"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p


def test_temp_file_is_owner_only_from_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real_fdopen = os.fdopen

    def spying_fdopen(fd: int, *args: object, **kw: object) -> object:
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))  # before a byte of the text is written
        return real_fdopen(fd, *args, **kw)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "fdopen", spying_fdopen)
    add_key(tmp_path / "t.toml", "acme", create_tenant=True, now=T0)
    assert seen == [0o600]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only root can give a file to another user")
def test_an_edit_by_root_keeps_the_files_owner(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    add_key(path, "acme", create_tenant=True, now=T0)
    os.chown(path, 4242, 4343)
    add_key(path, "acme", now=T0)
    st_ = os.stat(path)
    assert (st_.st_uid, st_.st_gid) == (4242, 4343)
