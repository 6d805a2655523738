# SPDX-License-Identifier: Apache-2.0
"""``SegmentGraphs``' feed before a replay (``step_graphs._copy_fed``): every fed argument lands
in the graph's own copy, grouped by dtype, a None argument skipped."""

import torch

from sglang.srt.speculative.ddtree.step_graphs import _copy_fed


def test_fed_arguments_land_in_the_graphs_copies():
    gen = torch.Generator().manual_seed(0)
    fed = (
        torch.rand(4, 1, generator=gen),  # temperatures [bs, 1]
        torch.randint(1, 50, (4,), generator=gen, dtype=torch.int32),  # top-ks
        torch.rand(4, generator=gen),  # top-ps
        None,
        torch.rand(4, generator=gen),  # min-ps
        torch.randint(0, 9, (4, 17), generator=gen),  # int64 tree rows
    )
    mine = tuple(None if t is None else torch.full_like(t, -3) for t in fed)
    addresses = [None if t is None else t.data_ptr() for t in mine]
    _copy_fed(mine, fed)
    for dst, src, addr in zip(mine, fed, addresses):
        if src is None:
            assert dst is None
            continue
        assert dst.data_ptr() == addr  # in place: the graph reads these addresses
        assert torch.equal(dst, src)


def test_a_single_tensor_and_nothing_fed():
    src = torch.arange(5)
    dst = torch.zeros(5, dtype=torch.int64)
    _copy_fed((dst,), (src,))
    assert torch.equal(dst, src)
    _copy_fed((), ())
    _copy_fed((None,), (None,))
