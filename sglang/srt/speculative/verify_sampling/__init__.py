# SPDX-License-Identifier: Apache-2.0
"""Lossless sampling for speculative verify (DFLASH chains and DDTREE trees).

``VerifySampler.target_tokens`` gives the target's token at every verified node exactly
as the server's sampler would pick it for that node's context (penalties along the
node's root path, grammar, logit bias, custom processors, temperature, top-k/top-p/min-p
and seeds by the sampling backend itself); acceptance is the greedy walk over those
tokens. ``request_check`` refuses per request what the verify cannot honour.
"""
