#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Download the pinned sglang wheel, verify its sha256 against upstream.lock, unpack the pristine tree.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# scripts/ on the module path for this one process: patchkit is a package there.
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m patchkit.fetch "$@"
