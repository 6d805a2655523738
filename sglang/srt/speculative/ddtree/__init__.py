# SPDX-License-Identifier: Apache-2.0
"""DDTree speculative decoding (Ringel & Romano, arXiv 2604.12989).

One DFlash draft forward yields L independent per-depth distributions; DDTree
turns them into the best token tree of at most B nodes under the draft, verifies
it in one target forward and keeps the longest path the target agrees with.

Algorithm core (pure tensor code, no scheduler state):

- ``draft_tree``   the selected tree's tensors (``DraftTree``)
- ``tree_build``   best-first top-B prefix selection, one Triton program per request
- ``tree_compile`` tokens, positions, ancestor bitmask, ``retrive_*`` links
- ``accept``       lossless greedy / target-only sampling acceptance
- ``kv_slot_plan`` which KV slots the accepted path keeps and where they go
- ``reference``    plain-Python references the tests compare against

Server side: ``worker`` (the decode step over upstream's DFlash worker, whose
private members it reaches only through ``dflash_internals``), ``step_io``
(the step's reads and writes of request state), ``draft_topk``, ``info``,
``metrics``, ``flags``, ``spec_algo``.

The package ``__init__`` imports nothing so that importing one submodule never
drags in the server.
"""
