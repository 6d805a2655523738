#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Thin wrapper: the logic is in scripts/patchkit/apply_cli.py (python >= 3.11, stdlib only).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# scripts/ on the module path for this one process: patchkit is a package there.
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m patchkit.apply_cli "$@"
