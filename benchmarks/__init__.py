# SPDX-License-Identifier: Apache-2.0
"""Benchmarks of ddtree-sglang (run as modules from the repository root: python3 -m benchmarks.NAME)."""
