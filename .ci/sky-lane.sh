#!/usr/bin/env bash
# The SkyPilot lane: validates the drivers' renders and parsers with SkyPilot itself, parses
# every `sky` command line the drivers build with SkyPilot's own CLI (test_sky_cli.py: a
# renamed or dropped flag fails here), and runs the status, endpoint, preflight and down
# commands against a private local API server (test_sky_live.py).
#
# SkyPilot (~460 MB) is not in the workspace's dev group, so this lane keeps its own virtual
# environment, cached across runs, with skypilot pinned by haru-driver-skypilot's `sky` extra.
# It runs every test marked `sky` in the two driver packages and FAILS when any of them was
# skipped or none ran: these tests skip themselves without SkyPilot, and a lane that silently
# skipped them would prove nothing.
#
# Environment:
#   HARU_SKY_VENV    where the environment lives (default: $HOME/.cache/haru/skyenv)
#   HARU_SKY_PYTHON  interpreter for a new environment (default: 3.11)
# Extra arguments are passed to pytest (e.g. -k schema, -x).
set -euo pipefail

SKYPILOT_VERSION="0.14.1"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HARU_SKY_VENV:-$HOME/.cache/haru/skyenv}"
PY="${HARU_SKY_PYTHON:-3.11}"
PACKAGES=(packages/driver-skypilot packages/driver-skyserve)

command -v uv >/dev/null || { echo "sky-lane: uv is required" >&2; exit 2; }
cd "$ROOT"

installed_version() {
    "$VENV/bin/python" -c \
        'import importlib.metadata as m; print(m.version("skypilot"))' 2>/dev/null || true
}

if [[ -x "$VENV/bin/python" && "$(installed_version)" == "$SKYPILOT_VERSION" ]]; then
    echo "sky-lane: reusing $VENV (skypilot $SKYPILOT_VERSION)"
else
    echo "sky-lane: creating $VENV with skypilot $SKYPILOT_VERSION"
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    uv venv --quiet --python "$PY" "$VENV"
fi

# Always (re)install the workspace packages: the checkout may have moved since the cache was
# made, and editable installs point at it. With the cache warm this takes a second or two.
VIRTUAL_ENV="$VENV" uv pip install --quiet \
    -e packages/protocol \
    -e packages/exec \
    -e "packages/driver-skypilot[sky]" \
    -e packages/driver-skyserve \
    "pytest>=8.3" "pytest-asyncio>=1.0" "pytest-timeout>=2.3" "hypothesis>=6.120"

if [[ "$(installed_version)" != "$SKYPILOT_VERSION" ]]; then
    echo "sky-lane: expected skypilot $SKYPILOT_VERSION in $VENV, found '$(installed_version)'" >&2
    exit 2
fi

REPORT_DIR="$(mktemp -d)"
trap 'rm -rf "$REPORT_DIR"' EXIT
REPORT="$REPORT_DIR/sky-lane.xml"

# The root pyproject's pytest config applies (strict markers/config, filterwarnings=error,
# importlib import mode). SkyPilot's import-time warnings are handled in the `sky` fixture.
set +e
SKYPILOT_DISABLE_USAGE_COLLECTION=1 "$VENV/bin/python" -m pytest "${PACKAGES[@]}" \
    -m sky -p no:cacheprovider --junitxml="$REPORT" "$@"
status=$?
set -e
if [[ $status -ne 0 ]]; then
    echo "sky-lane: pytest failed (exit $status)" >&2
    exit "$status"
fi

"$VENV/bin/python" - "$REPORT" <<'PY'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "skipped", "failures", "errors")}
print(
    f"sky-lane: {count['tests']} tests, {count['skipped']} skipped, "
    f"{count['failures']} failed, {count['errors']} errors"
)
if count["tests"] == 0:
    sys.exit("sky-lane: no sky test ran")
if count["skipped"]:
    sys.exit("sky-lane: sky tests were skipped; they must run against SkyPilot")
if count["failures"] or count["errors"]:
    sys.exit("sky-lane: failures")
PY
