# SPDX-License-Identifier: Apache-2.0
"""DFlash 2 drafters on the pinned release.

A DFlash 2 checkpoint (``architectures: ["DFlash2DraftModel"]``) is a DFlash
drafter with two additions: a grouped dynamic convolution around each layer's
attention and MLP, and a candidate selector that keeps the top-K tokens of every
block slot and scores the K x K transitions between adjacent slots.

- ``config``    the checkpoint's DFlash 2 fields and the start-up refusals
- ``selector``  candidate top-K, the transition lattice, the path walk
- ``dflash_step`` what ``DFlashWorkerV2`` (DFLASH) calls for a DFlash 2 drafter (patch 0056)

The model itself is ``sglang.srt.models.dflash2``. The package ``__init__``
imports nothing, so importing one submodule never drags in the server.
"""
