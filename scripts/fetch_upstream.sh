#!/usr/bin/env bash
# Download the pinned sglang wheel, verify its sha256 against upstream.lock, unpack the pristine tree.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" -c 'import sys; sys.path.insert(0, sys.argv[1]); from patchkit.fetch import main; sys.exit(main(sys.argv[2:]))' "$here" "$@"
