#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU e2e server tests only (tests/gpu/e2e): run_gpu_tier.sh --only e2e.
# Logs: <piece>-pytest.log and <piece>-server-logs.tgz per e2e share in /tmp/ddtree-out (for
# another folder: scripts/gpu_host/run_gpu_tier.sh --only e2e --out DIR).
#   scripts/gpu_host/run_e2e.sh [pytest args...]
#   DDTREE_E2E_CONFIGS=triton-nospec,triton-dflash scripts/gpu_host/run_e2e.sh -x
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_gpu_tier.sh" --only e2e -- "$@"
