# SPDX-License-Identifier: Apache-2.0
"""``speculative/ddtree/verify_graphs.py``: which width's graphs serve a verify, and the
target model runner's backend and graph runner swapped for it and restored after, even when
the verify raises. (The capture itself needs a GPU: ``tests/gpu/ddtree``.)"""

from types import SimpleNamespace

import pytest

from sglang.srt.speculative.ddtree.verify_graphs import VerifyGraphRunner, VerifyGraphs


def _graphs():
    own_backend, own_runner = object(), object()
    mr = SimpleNamespace(attn_backend=own_backend, decode_cuda_graph_runner=own_runner)
    narrow = VerifyGraphRunner(width=17, attn_backend=object(), graph_runner=object(), max_bs=8)
    tiny = VerifyGraphRunner(width=5, attn_backend=object(), graph_runner=object(), max_bs=4)
    return mr, own_backend, own_runner, VerifyGraphs(mr, [narrow, tiny]), narrow


def test_lookup_by_width_and_batch_size():
    _, _, _, graphs, narrow = _graphs()
    assert graphs.widths == (5, 17)
    assert graphs.lookup(17, 1) is narrow and graphs.lookup(17, 8) is narrow
    assert graphs.lookup(17, 9) is None  # beyond its captured batch sizes: eager, as upstream's runner
    assert graphs.lookup(65, 1) is None  # the full width: the model runner's own graphs
    assert graphs.lookup(9, 1) is None  # not a graph budget's width
    assert VerifyGraphs(SimpleNamespace()).lookup(17, 1) is None


def test_active_swaps_and_restores():
    mr, own_backend, own_runner, graphs, narrow = _graphs()
    with graphs.active(narrow) as backend:
        assert backend is narrow.attn_backend
        assert (mr.attn_backend, mr.decode_cuda_graph_runner) == (narrow.attn_backend, narrow.graph_runner)
    assert (mr.attn_backend, mr.decode_cuda_graph_runner) == (own_backend, own_runner)
    with graphs.active(None) as backend:
        assert backend is own_backend and mr.decode_cuda_graph_runner is own_runner
    with pytest.raises(RuntimeError, match="verify failed"):
        with graphs.active(narrow):
            raise RuntimeError("verify failed")
    assert (mr.attn_backend, mr.decode_cuda_graph_runner) == (own_backend, own_runner)


def test_capture_refuses_a_width_that_is_not_below_the_full_one():
    with pytest.raises(ValueError, match=r"must lie in \[1, 64\], got 65"):
        VerifyGraphs.capture(SimpleNamespace(), [65], full_width=65)


def test_the_pinned_upstream_has_what_the_capture_uses():
    """The capture builds a backend and a graph runner through upstream's own factories; a
    bump that renames them fails here, not in a server's start."""
    import inspect

    from sglang.srt.arg_groups.arg_utils import namespace_of
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.server_args import ServerArgs

    assert callable(ModelRunner._get_attention_backend) and callable(ModelRunner._decode_cuda_graph_runner_cls)
    assert "init_new_workspace" in inspect.signature(ModelRunner._get_attention_backend).parameters
    params = inspect.signature(DecodeCudaGraphRunner.__init__).parameters
    assert {"attn_backend", "speculative_num_draft_tokens"} <= set(params)
    assert "self.max_bs = " in inspect.getsource(DecodeCudaGraphRunner.__init__)
    # The width the backends and the runner read is a spec-config field an override may set.
    assert namespace_of(ServerArgs)["speculative_num_draft_tokens"].split(".")[0] == "spec"
