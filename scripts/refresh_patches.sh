#!/usr/bin/env bash
# Thin wrapper: the logic is in scripts/patchkit/refresh_cli.py (python >= 3.11, stdlib only).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" -c 'import sys; sys.path.insert(0, sys.argv[1]); from patchkit.refresh_cli import main; sys.exit(main(sys.argv[2:]))' "$here" "$@"
