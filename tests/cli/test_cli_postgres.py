"""The command on a PostgreSQL store: demo, crash and resume, runs, show and verify.

Each test gets an empty database of its own (see ``kit/pg.py`` for where the server comes
from and when these tests skip or fail).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from kit import pg
from kit import surrogate as surrogate_kit
from kit.show import without_times
from kit.surrogate import HALF, RUN_ID, SHOWN, StrictOutput
from polyloop import run_trace_id
from polyloop.cli import main

# pytest-postgresql's throw-away server, started only if no configured server answers.
pg_fallback_proc = pg.fallback_server()


@pytest.fixture(scope="session")
def pg_server(request: pytest.FixtureRequest) -> str:
    return pg.server_conninfo(request, "pg_fallback_proc")


@pytest.fixture
def conninfo(pg_server: str) -> Iterator[str]:
    with pg.fresh_database(pg_server) as info:
        yield info


def as_url(conninfo: str) -> str:
    """The command takes ``postgresql://`` URLs; the fixtures may hand out key=value."""
    if conninfo.startswith(("postgresql://", "postgres://")):
        return conninfo
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(conninfo)
    user = params.get("user", "")
    password = f":{params['password']}" if params.get("password") else ""
    auth = f"{user}{password}@" if user else ""
    host = params.get("host", "localhost")
    port = f":{params['port']}" if params.get("port") else ""
    return f"postgresql://{auth}{host}{port}/{params.get('dbname', '')}"


@pytest.mark.slow
def test_the_whole_command_on_postgresql(conninfo: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = as_url(conninfo)
    crashed = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyloop",
            "demo",
            "--pace",
            "0",
            "--store",
            url,
            "--crash-after-writes",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert crashed.returncode == 3, crashed.stderr
    match = re.search(r"demo run (demo-[0-9a-f]{8})", crashed.stdout)
    assert match is not None
    run_id = match.group(1)

    # The crashed worker's lease holds the run until most of it has run out (research
    # record 0034): listed as running with its owner, then resumable.
    assert main(["runs", url, "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    state = json.loads(line)["state"]
    assert state in ("running", "resumable")

    assert main(["demo", "--pace", "0", "--store", url, "--resume", run_id]) == 0
    out = capsys.readouterr().out
    assert "3 steps read back from the log (not run again)" in out
    assert ("held under a lease" in out) is (state == "running")
    assert "no step was repeated" in out

    assert main(["runs", url]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if run_id in line]
    assert without_times(row[0]).split() == [run_id, "finished", "submitted", "7", "6"]

    assert main(["show", url, run_id, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["state"] == "finished"
    assert len(document["steps"]) == 7

    assert main(["verify", url]) == 0
    assert "1 run checked: 1 clean" in capsys.readouterr().out

    assert main(["show", url, "nobody"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("polyloop: error: unknown run id 'nobody' in postgresql://")
    assert err.count("\n") == 1


def test_verify_names_a_corrupt_row_on_postgresql(
    conninfo: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = as_url(conninfo)
    assert main(["demo", "--pace", "0", "--store", url]) == 0
    capsys.readouterr()
    with pg.admin(conninfo) as conn:
        conn.execute("UPDATE polyloop.records SET body = 'nope' WHERE seq = 5")
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert re.search(
        r"error    demo-[0-9a-f]{8}  polyloop\.records run .* seq 5: "
        r"not a JSON record",
        out,
    ), out


def test_an_unreachable_server_is_one_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "postgresql://me:pw@127.0.0.1:1/none"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("polyloop: error: cannot connect to postgresql://me:***@127.0.0.1:1")
    assert "pw@" not in err


# Every command but the demo works on a store that exists; each, given a mistyped schema.
EXISTING_ONLY = [
    ["runs"],
    ["runs", "--json"],
    ["show", "demo-1"],
    ["show", "demo-1", "--json"],
    ["verify"],
    ["verify", "demo-1"],
    ["pending"],
    ["prune", "--finished-before", "2999-01-01"],
    ["approve", "demo-1", "--by", "ann"],
    ["reject", "demo-1", "--by", "ann", "--reason", "no"],
    ["settle", "demo-1", "--by", "ann", "--did-not-run", "--reason", "no"],
]


def _schemas(conninfo: str) -> set[str]:
    with pg.admin(conninfo) as conn:
        return {name for (name,) in conn.execute("SELECT nspname FROM pg_namespace")}


def _tables(conninfo: str) -> set[tuple[str, str]]:
    with pg.admin(conninfo) as conn:
        rows = conn.execute("SELECT schemaname, tablename FROM pg_tables")
        return {(schema, table) for schema, table in rows}


@pytest.fixture(scope="module")
def demo_database(pg_server: str) -> Iterator[str]:
    """A database holding the demo's run, written once for the tests that only read it
    and check that they changed nothing."""
    with pg.fresh_database(pg_server) as info:
        assert main(["demo", "--pace", "0", "--store", as_url(info)]) == 0
        yield info


@pytest.mark.parametrize("command", EXISTING_ONLY, ids=" ".join)
def test_a_mistyped_schema_is_named_and_never_created(
    demo_database: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    conninfo = demo_database
    url = as_url(conninfo)
    schemas, tables = _schemas(conninfo), _tables(conninfo)
    assert "polyloop" in schemas and "Upper" not in schemas

    # The password is masked; the trust login lets it through unused.
    with_password = pg.as_url(conninfo, password="s3cret")
    shown = with_password.replace(":s3cret@", ":***@")
    assert main([command[0], with_password, *command[1:], "--schema", "Upper"]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == (
        "",
        f"polyloop: error: {shown}: no PolyLoop store in schema 'Upper': "
        "the schema does not exist\n",
    )
    # A schema that exists but holds no store is refused too, and left as it was.
    assert main([command[0], url, *command[1:], "--schema", "public"]) == 1
    assert capsys.readouterr().err == (
        f"polyloop: error: {url}: no PolyLoop store in schema 'public': "
        "the schema holds no PolyLoop tables\n"
    )
    assert _schemas(conninfo) == schemas
    assert _tables(conninfo) == tables


def test_resuming_the_demo_in_a_mistyped_schema_creates_nothing(
    conninfo: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = as_url(conninfo)
    assert main(["demo", "--pace", "0", "--store", url]) == 0
    capsys.readouterr()
    schemas, tables = _schemas(conninfo), _tables(conninfo)
    resume = ["demo", "--pace", "0", "--resume", "demo-1", "--store", url, "--schema", "Upper"]
    assert main(resume) == 1
    assert capsys.readouterr().err == (
        f"polyloop: error: {url}: no PolyLoop store in schema 'Upper': the schema does not exist\n"
    )
    assert _schemas(conninfo) == schemas
    assert _tables(conninfo) == tables


def test_lone_surrogates_are_shown_escaped_on_postgresql(
    conninfo: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from polyloop.stores import PostgresStore

    url = as_url(conninfo)
    anyio.run(surrogate_kit.fill, PostgresStore(conninfo))
    output = StrictOutput(monkeypatch)
    assert main(["show", url, "half"]) == 0
    assert f"done {SHOWN}" in output.read()[0]
    assert main(["show", url, "half", "--json"]) == 0
    assert json.loads(output.read()[0])["final_answer"] == f"done {HALF}"
    target = tmp_path / "half.html"
    assert main(["show", url, "half", "--html", str(target)]) == 0
    assert f"done {SHOWN}" in target.read_text(encoding="utf-8")
    shown = RUN_ID.replace(HALF, SHOWN)
    assert main(["show", url, RUN_ID]) == 0
    assert f"trace id {run_trace_id(RUN_ID)}" in " ".join(output.read()[0].split())
    assert main(["show", url, RUN_ID, "--json"]) == 0
    assert json.loads(output.read()[0])["trace_id"] == run_trace_id(RUN_ID)
    assert main(["show", url, RUN_ID, "--html", str(tmp_path / "id.html")]) == 0
    assert run_trace_id(RUN_ID) in (tmp_path / "id.html").read_text(encoding="utf-8")
    output.read()
    assert main(["runs", url]) == 0
    assert f"{shown}   finished" in output.read()[0]
    assert main(["verify", url]) == 0
    out, err = output.read()
    assert f"ok       {shown} (" in out and "3 runs checked: 3 clean" in out and err == ""
    assert main(["pending", url]) == 0
    assert f'send({{"answer": "hi {SHOWN}"}})' in output.read()[0]
