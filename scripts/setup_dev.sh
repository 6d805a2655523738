#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One-command dev environment: .venv with the pinned upstream sglang (hash-checked wheel), its
# pinned dependencies and the test tools; the pristine upstream tree under .cache/upstream/;
# the overlay and patch series applied to the venv's sglang.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"

"$PYTHON" - <<'PY' || { echo "error: $PYTHON must be Python 3.11-3.13 (sglang 0.5.17 wheels + tomllib)" >&2; exit 1; }
import sys; sys.exit(0 if (3, 11) <= sys.version_info[:2] <= (3, 13) else 1)
PY
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
VPY=.venv/bin/python

echo "== fetching and verifying sglang (upstream.lock)"
fetched="$(PYTHON="$VPY" scripts/fetch_upstream.sh --python "$VPY")"
wheel="$(sed -n 1p <<<"$fetched")"
echo "   wheel: $wheel"
echo "   pristine tree: $(sed -n 2p <<<"$fetched")"

echo "== installing sglang and its pinned dependencies into .venv (first time: several minutes, ~9 GB)"
# The machine-wide pip config may list local index mirrors that do not exist; their warnings are noise.
"$VPY" -m pip install -q "$wheel" -r requirements-dev.txt -c constraints/dev.txt 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
"$VPY" -m pip check >/dev/null 2>&1 || echo "note: pip check reports dependency conflicts in upstream's own pins (not fatal)"

echo "== applying the overlay and patch series"
PYTHON="$VPY" scripts/apply_patches.sh --python "$VPY"
echo "== done: run 'make test'"
