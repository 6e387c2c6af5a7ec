#!/usr/bin/env bash
# Install (scripts/install.sh) and run the default test suite plus ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
