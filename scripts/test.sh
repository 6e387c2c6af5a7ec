#!/usr/bin/env bash
# Install (scripts/install.sh) and run the default test suite plus ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install.sh
# The KV page's browser test drives Debian's own Chromium (nothing downloads a browser build).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
fi
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
