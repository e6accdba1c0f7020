#!/bin/sh
# Install Haru services, and nothing else, into a fresh virtual environment.
#
#   deploy/install-service.sh VENV PACKAGE[:EXTRA,...] [PACKAGE[:EXTRA,...] ...]
#
# Run from the repository root (uv.lock pins every version). The Dockerfiles run exactly this,
# and tests/test_images.py runs it into a temporary directory and starts the
# result, so the image and the test install the same way. Each PACKAGE is a workspace member
# (haru-server, haru-supervisor, haru-sim); its workspace dependencies are installed as wheels
# (not editable), its third-party dependencies at the locked versions with their hashes.
# UV_OFFLINE=1 installs from uv's cache only.
set -eu

if [ "$#" -lt 2 ]; then
  echo "usage: $0 VENV PACKAGE[:EXTRA,...] [PACKAGE[:EXTRA,...] ...]" >&2
  exit 2
fi
venv=$1
shift

export_args=""
for spec in "$@"; do
  package=${spec%%:*}
  export_args="$export_args --package $package"
  if [ "$package" != "$spec" ]; then
    for extra in $(echo "${spec#*:}" | tr ',' ' '); do
      export_args="$export_args --extra $extra"
    done
  fi
done

requirements=$(mktemp)
trap 'rm -f "$requirements"' EXIT

# 1. The locked dependency closure of the package(s): no dev group, workspace members as
#    local paths built into wheels.
# shellcheck disable=SC2086  # word splitting of the argument list is intended
uv export --frozen --no-dev --no-editable --no-header $export_args --output-file "$requirements" \
  --quiet
# 2. A fresh virtual environment on the interpreter uv finds (the image's python3).
uv venv --quiet --no-project "$venv"
# 3. Exactly that closure, nothing resolved anew (--no-deps).
uv pip install --quiet --no-deps --python "$venv/bin/python" --requirements "$requirements"
