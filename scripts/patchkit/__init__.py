# SPDX-License-Identifier: Apache-2.0
"""Tooling for the ddtree-sglang patch series (stdlib only: it runs where nothing is installed)."""
