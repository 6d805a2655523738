# SPDX-License-Identifier: Apache-2.0
"""The benchmarks' plotting back end."""

import sys


def pyplot():
    """matplotlib's pyplot on the file-only Agg back end, or None when matplotlib
    is missing (said on stderr): a benchmark's JSON never depends on its plot."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
