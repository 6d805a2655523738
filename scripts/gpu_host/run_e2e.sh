#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU e2e server tests only (tests/gpu/e2e): run_gpu_tier.sh --only e2e.
# Logs: $OUT/e2e-pytest.log, $OUT/e2e-server-logs.tgz (or under /tmp/ddtree-out).
#   scripts/gpu_host/run_e2e.sh [pytest args...]
#   DDTREE_E2E_CONFIGS=triton-nospec,triton-dflash scripts/gpu_host/run_e2e.sh -x
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_gpu_tier.sh" --only e2e -- "$@"
