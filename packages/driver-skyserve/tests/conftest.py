from __future__ import annotations

import socket
import sys
import types
import warnings
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def sky(tmp_path_factory: pytest.TempPathFactory) -> Iterator[types.ModuleType]:
    """SkyPilot itself, imported in an isolated environment; skips without the ``sky`` extra.

    Before the import (SkyPilot caches paths and its server URL process-wide): HOME is a temp
    folder (``import sky`` writes ``~/.sky``), usage collection is off, and any API server is
    a private one on a free port (SKYPILOT_API_SERVER_LOCAL_PORT, honoured by client and
    server), so an operator's server is neither used nor stopped. The sky lane
    (.ci/sky-lane.sh) installs the extra and fails if these tests were skipped.
    """
    imported = sys.modules.get("sky")
    if imported is not None:
        # The other driver package's fixture set this session up; it stays active until the
        # session ends, and a second HOME or port would split SkyPilot's process-wide state.
        yield imported
        return
    home = tmp_path_factory.mktemp("sky-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        mp.setenv("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")
        mp.setenv("SKYPILOT_API_SERVER_LOCAL_PORT", str(_free_port()))
        mp.delenv("SKYPILOT_API_SERVER_ENDPOINT", raising=False)
        # SkyPilot's own imports emit deprecation warnings (SQLAlchemy declarative_base, ...)
        # that the suite's filterwarnings=error would turn into failures; they are not ours.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = pytest.importorskip("sky")
            pytest.importorskip("sky.serve")
            pytest.importorskip("sky.utils.schemas")
            pytest.importorskip("sky.utils.common_utils")
        yield module
