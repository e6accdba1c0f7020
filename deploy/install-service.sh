#!/bin/sh
# Install Haru services, and nothing else, into a virtual environment.
#
#   deploy/install-service.sh [--dependencies-only] VENV PACKAGE[:EXTRA,...] [PACKAGE[:EXTRA,...] ...]
#
# Run from the repository root (uv.lock pins every version). The Dockerfiles run exactly this,
# and tests/test_images.py runs it into a temporary directory and starts the result, so the
# image and the test install the same way. Each PACKAGE is a workspace member (haru-server,
# haru-supervisor, haru-sim); its workspace dependencies are installed as wheels (not
# editable), its third-party dependencies at the locked versions with their hashes, nothing
# resolved anew (--frozen) and nothing else (no dev group; a package outside the closure is
# removed).
#
# --dependencies-only installs the third-party closure alone, from uv.lock and the root
# pyproject.toml (nothing else of the repository is read): an image builds it in a layer of
# its own, which a code change does not rebuild. The second run (without the flag) adds the
# workspace members. UV_OFFLINE=1 installs from uv's cache only.
set -eu

usage="usage: $0 [--dependencies-only] VENV PACKAGE[:EXTRA,...] [PACKAGE[:EXTRA,...] ...]"
only=""
if [ "${1:-}" = "--dependencies-only" ]; then
  only="--no-install-workspace"
  shift
fi
if [ "$#" -lt 2 ]; then
  echo "$usage" >&2
  exit 2
fi
venv=$1
shift

sync_args=""
for spec in "$@"; do
  package=${spec%%:*}
  sync_args="$sync_args --package $package"
  if [ "$package" != "$spec" ]; then
    for extra in $(echo "${spec#*:}" | tr ',' ' '); do
      sync_args="$sync_args --extra $extra"
    done
  fi
done

# The environment is VENV (created on the interpreter uv finds: the image's python3).
# shellcheck disable=SC2086  # word splitting of the argument lists is intended
UV_PROJECT_ENVIRONMENT=$venv uv sync --frozen --no-dev --no-editable --quiet $only $sync_args
