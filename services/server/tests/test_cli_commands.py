"""The ``haru`` CLI's shape: what it imports at start, ``--version``, and the commands that
installed packages register under the ``haru.commands`` entry-point group."""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import haru_server
import pytest
from haru_server.cli import COMMAND_GROUP, build_app, discover_commands
from typer.testing import CliRunner

STORE_MODULES = {"sqlalchemy", "alembic", "haru_db"}


def imported_by(argv: list[str]) -> set[str]:
    """Top-level modules a fresh interpreter holds after running ``haru ARGV``."""
    probe = (
        "import contextlib, io, sys\n"
        f"sys.argv = ['haru', *{argv!r}]\n"
        "from haru_server.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main()\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    return set(done.stdout.split())


def test_help_imports_no_state_store_no_aiohttp_and_no_registered_command() -> None:
    modules = imported_by(["--help"])
    assert "haru_server" in modules  # the probe did run the CLI
    assert modules.isdisjoint({*STORE_MODULES, "aiohttp", "haru_demo", "pydantic"})


@pytest.mark.parametrize(
    "argv",
    [
        ["fleets", "--help"],
        ["fleet", "show", "--help"],
        ["promote", "--help"],
        ["events", "--help"],
        ["serve", "--help"],
        ["db", "upgrade", "--help"],
        ["db", "current", "--help"],
    ],
)
def test_command_help_imports_no_state_store(argv: list[str]) -> None:
    modules = imported_by(argv)
    assert "haru_server" in modules
    assert modules.isdisjoint(STORE_MODULES)


def test_an_http_command_runs_without_the_state_store() -> None:
    # A refused connection: the command ran its client and failed, without the store.
    probe = (
        "import contextlib, sys\n"
        "sys.argv = ['haru', 'fleets', '--url', 'http://127.0.0.1:9']\n"
        "from haru_server.cli import main\n"
        "code = None\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "print(code, ' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    code, *modules = done.stdout.split()
    assert code == "5", done.stderr  # EXIT_UNREACHABLE
    assert "aiohttp" in modules
    assert set(modules).isdisjoint(STORE_MODULES)


def test_version_prints_the_installed_distribution_version() -> None:
    result = CliRunner().invoke(build_app([]), ["--version"])
    assert result.exit_code == 0
    assert result.output == f"haru (haru-server) {metadata.version('haru-server')}\n"


def test_without_haru_demo_the_demo_command_says_how_to_get_it() -> None:
    app = build_app([])
    listing = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert listing.exit_code == 0
    assert "not installed: pip install haru-demo" in listing.output
    for argv in (["demo"], ["demo", "--scenario-only"], ["demo", "--help"]):
        result = CliRunner().invoke(app, argv, env={"COLUMNS": "200"})
        assert result.exit_code == 2, argv
        assert "haru demo comes with the haru-demo package" in result.output
        assert "pip install haru-demo" in result.output
        assert "uv run haru demo" in result.output


def test_the_workspace_registers_haru_demo() -> None:
    entries = {entry.name: entry for entry in discover_commands()}
    assert entries["demo"].value == "haru_demo._command:app"
    assert entries["demo"].group == COMMAND_GROUP


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"haru_test_plugin_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        "import typer\n"
        "app = typer.Typer()\n"
        "@app.command()\n"
        "def hello(name: str = typer.Option('world', '--name')) -> None:\n"
        '    """Say hello."""\n'
        "    print(f'hello {name}')\n"
        "def plain(times: int = 1) -> None:\n"
        '    """Print a plain line."""\n'
        "    print('plain ' * times)\n"
        "not_a_command = 42\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def entry(name: str, value: str) -> metadata.EntryPoint:
    return metadata.EntryPoint(name=name, value=value, group=COMMAND_GROUP)


def test_a_registered_command_is_listed_without_import_and_runs(plugin_module: str) -> None:
    app = build_app(
        [entry("hello", f"{plugin_module}:app"), entry("plain", f"{plugin_module}:plain")]
    )
    listing = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert listing.exit_code == 0
    assert "hello" in listing.output
    assert f"({plugin_module}:app)" in listing.output
    assert plugin_module not in sys.modules

    result = CliRunner().invoke(app, ["hello", "--name", "haru"])
    assert result.exit_code == 0, result.output
    assert result.output == "hello haru\n"
    result = CliRunner().invoke(app, ["plain", "--times", "2"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "plain plain"


def test_a_registered_command_cannot_replace_a_builtin(plugin_module: str) -> None:
    app = build_app([entry("serve", f"{plugin_module}:app")])
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "Run the control server" in result.output


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("haru_no_such_module_anywhere:app", "cannot load command 'broken'"),
        ("{module}:not_a_command", "is not a Typer app or function"),
    ],
)
def test_a_broken_registration_is_an_error_not_a_traceback(
    plugin_module: str, value: str, message: str
) -> None:
    app = build_app([entry("broken", value.format(module=plugin_module))])
    result = CliRunner().invoke(app, ["broken"], env={"COLUMNS": "200"})
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output


def test_the_python_api_is_haru_server_api_and_the_package_loads_nothing() -> None:
    # The package module is empty (the CLI starts without the server); the API module holds
    # every public name, each documented in the README or by its own docstring.
    assert haru_server.__all__ == ()
    assert not hasattr(haru_server, "create_app")
    api = importlib.import_module("haru_server.api")
    readme = (Path(haru_server.__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    assert len(set(api.__all__)) == len(api.__all__)
    for name in api.__all__:
        value = getattr(api, name)
        assert getattr(value, "__name__", name) == name or name == "Clock"  # Clock: an alias
        assert value.__doc__ or f"`{name}" in readme, name
