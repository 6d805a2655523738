# SPDX-License-Identifier: Apache-2.0
"""The verify sampler's draws on the GPU, with the server's default sampling backend
(FlashInfer), against upstream's ``Sampler.forward`` on the same logits (no server).

What a server-level two-sample test cannot separate: whether each node's draw has the
distribution the sampler draws from for that node's logits (top-k with top-p, min-p,
temperature; rows of several requests with their own parameters), and whether draws are
independent: between the nodes of one verify, between consecutive verifies, and between
the prefill's draw and the first verify's root draw. Each test runs with the verify's
fused draw (the default) and with ``SGLANG_DDTREE_VERIFY_DRAW=sampler`` (FlashInfer's
kernels, whose philox offsets come from torch's generator). GPU host only.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "cpu" / "verify_sampling"))
from _upstream import Batch, Req, params  # noqa: E402

from benchmarks.sampling_check import homogeneity  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.speculative.verify_sampling.node_logits import NodePaths, chain_paths  # noqa: E402
from sglang.srt.speculative.verify_sampling.verify_sampler import VerifySampler  # noqa: E402

VOCAB = 8192  # the learned pair's
DEV = "cuda"
#: What the server-level check rejected (2026-12-04), each piece alone, and plain T=1.
SETTINGS = {
    "T0.7-k20-p0.8-minp0.05": dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05),
    "T0.7-k20-p0.8": dict(temperature=0.7, top_k=20, top_p=0.8),
    "T0.7-k20": dict(temperature=0.7, top_k=20),
    "T0.7-p0.8": dict(temperature=0.7, top_p=0.8),
    "T0.7-minp0.05": dict(temperature=0.7, min_p=0.05),
    "T1": dict(temperature=1.0),
}
ALPHA = 1e-4  # per test; a real difference here shows p-values below 1e-20


@pytest.fixture(scope="module")
def flashinfer_sampler(tmp_path_factory):
    """Upstream's Sampler on one rank with the FlashInfer sampling backend (the default)."""
    import json

    from sglang.srt.layers import sampler as sampler_mod
    from sglang.srt.runtime_context import get_exec, publish, reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.verify_sampling import verify_sampler as vs_mod

    model = tmp_path_factory.mktemp("node_draws_model")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}))  # fmt: skip
    sa = ServerArgs(model_path=str(model), device="cuda", skip_tokenizer_init=True)
    publish(sa, role="test")
    saved = (sampler_mod.get_tp_group, vs_mod.get_tp_group)
    sampler_mod.get_tp_group = lambda: SimpleNamespace(device_group=None)
    vs_mod.get_tp_group = lambda: SimpleNamespace(world_size=1)
    try:
        assert get_exec().kernel.sampling_backend == "flashinfer", get_exec().kernel.sampling_backend
        yield sampler_mod.Sampler()
    finally:
        sampler_mod.get_tp_group, vs_mod.get_tp_group = saved
        reset_context()


def _info(reqs) -> SamplingBatchInfo:
    batch = Batch(reqs)
    batch.device = DEV
    return SamplingBatchInfo.from_schedule_batch(batch, VOCAB).copy_for_forward()


def _sampler_draws(sampler, logits: torch.Tensor, reqs) -> torch.Tensor:
    """What the server without speculation draws for each row (one request per row)."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    out = LogitsProcessorOutput(next_token_logits=logits.clone())
    return sampler.forward(out, _info(reqs), False, [], [], torch.zeros(len(reqs), dtype=torch.int64, device=DEV))


@pytest.fixture(params=["fused", "sampler"])
def draw(request, monkeypatch):
    """How the verify draws unseeded nodes (``SGLANG_DDTREE_VERIFY_DRAW``)."""
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_DRAW", request.param)
    return request.param


def _verify(sampler) -> VerifySampler:
    return VerifySampler(vocab_size=VOCAB, device=DEV, sampler=sampler, sampling_backend="flashinfer")


def _context_logits(seed: int, rows: int = 1) -> torch.Tensor:
    """Logits shaped like a small LM's: 30 likely tokens of graded weight, then a long tail,
    so that every filter here cuts somewhere inside the likely tokens."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn(rows, VOCAB, device=DEV, generator=gen)
    likely = torch.rand(rows, VOCAB, device=DEV, generator=gen).argsort(dim=-1)[:, :30]
    logits.scatter_add_(1, likely, torch.linspace(7.0, 2.0, 30, device=DEV).expand(rows, 30).contiguous())
    return logits.float()


def _two_sample_p(a: torch.Tensor, b: torch.Tensor, categories: int = 3) -> Optional[float]:
    """The sampling check's chi-square test that two samples of tokens come from one
    distribution; None when they fall in fewer than ``categories`` bins (a near-deterministic
    draw says nothing)."""
    test = homogeneity(Counter(a.view(-1).tolist()), Counter(b.view(-1).tolist()))
    return None if test["bins"] < categories else test["p"]


def _independence_p(x: torch.Tensor, y: torch.Tensor, top: int = 6) -> float:
    """Chi-square test that paired draws ``x``, ``y`` are independent (their ``top`` most
    frequent tokens, the rest pooled)."""
    from scipy.stats import chi2_contingency

    def binned(t):
        common = torch.bincount(t.long(), minlength=VOCAB).topk(top).indices
        out = torch.full_like(t, top)
        for i, tok in enumerate(common.tolist()):
            out[t == tok] = i
        return out

    bx, by = binned(x), binned(y)
    table = torch.zeros(top + 1, top + 1, dtype=torch.int64, device=x.device)
    table.index_put_((bx.long(), by.long()), torch.ones_like(bx, dtype=torch.int64), accumulate=True)
    t = table.cpu().numpy()
    t = t[t.sum(1) > 0][:, t.sum(0) > 0]
    assert min(t.shape) >= 3, f"too few distinct draws for the test to mean anything: {t.shape}"
    return float(chi2_contingency(t)[1])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_node_draws_what_the_sampler_draws(flashinfer_sampler, draw, name):
    """20,000 rows of one context: as 1,250 requests x 16 chain nodes through the verify, and
    as 20,000 requests through the sampler."""
    p = params(**SETTINGS[name])
    bs, n = 1250, 16
    logits = _context_logits(1).expand(bs * n, VOCAB).contiguous()
    reqs = [Req(p, [5, 6, 7], [9], pool_idx=i, prefilled_outputs=1) for i in range(bs)]
    paths = chain_paths(torch.full((bs, n), 9, device=DEV))
    positions = torch.arange(n, device=DEV).expand(bs, n).contiguous()
    ours = _verify(flashinfer_sampler).target_tokens(logits.clone(), _info(reqs), reqs, paths, positions).tokens
    theirs = _sampler_draws(flashinfer_sampler, logits[: bs * n],
                            [Req(p, [5, 6, 7], [9], pool_idx=i) for i in range(bs * n)])  # fmt: skip
    p = _two_sample_p(ours, theirs)
    assert p is not None and p > ALPHA, p


def test_rows_of_requests_with_their_own_parameters(flashinfer_sampler, draw):
    """Four requests of different parameters and a tree of 17 nodes each, every node its own
    logits: 2,000 verifies against 2,000 sampler draws per node."""
    kinds = list(SETTINGS.values())[:4]
    bs, n, steps = 4, 17, 2000
    reqs = [Req(params(**kinds[b]), [5, 6, 7], [9], pool_idx=b, prefilled_outputs=1) for b in range(bs)]
    logits = _context_logits(2, bs * n)
    parent = torch.tensor([-1] + [max(0, (i - 1) // 2) for i in range(1, n)], device=DEV).expand(bs, n)
    depth = torch.zeros(bs, n, dtype=torch.int32, device=DEV)
    for i in range(1, n):
        depth[:, i] = depth[:, int(parent[0, i])] + 1
    paths = NodePaths(torch.full((bs, n), 9, device=DEV), parent.contiguous(), depth, int(depth.max()))
    positions = depth.to(torch.int64)
    vs = _verify(flashinfer_sampler)
    info = _info(reqs)
    ours = torch.stack([vs.target_tokens(logits.clone(), info, reqs, paths, positions).tokens.view(-1)
                        for _ in range(steps)])  # fmt: skip
    row_reqs = [Req(reqs[r // n].sampling_params, [5, 6, 7], [9], pool_idx=r) for r in range(bs * n)]
    theirs = torch.stack([_sampler_draws(flashinfer_sampler, logits, row_reqs).view(-1) for _ in range(steps)])
    tested = [(p, r) for r in range(bs * n) if (p := _two_sample_p(ours[:, r], theirs[:, r])) is not None]
    assert len(tested) >= bs * n // 2, f"only {len(tested)} of {bs * n} nodes draw three or more tokens"
    worst = min(tested)
    assert worst[0] > ALPHA / len(tested), f"node row {worst[1]}: p = {worst[0]:.3g}"


def test_draws_are_independent_across_nodes_steps_and_the_prefill(flashinfer_sampler, draw):
    """The same logits at every node: the root's draw is independent of a child's in the same
    verify, of its own draw in the next verify, and of the prefill's draw just before."""
    p = params(**SETTINGS["T0.7-k20-p0.8-minp0.05"])
    bs, n = 4000, 4
    logits = _context_logits(3).expand(bs * n, VOCAB).contiguous()
    reqs = [Req(p, [5, 6, 7], [9], pool_idx=i, prefilled_outputs=1) for i in range(bs)]
    paths = chain_paths(torch.full((bs, n), 9, device=DEV))
    positions = torch.arange(n, device=DEV).expand(bs, n).contiguous()
    vs = _verify(flashinfer_sampler)
    info = _info(reqs)
    prefill = _sampler_draws(flashinfer_sampler, logits[:bs], reqs).view(-1)
    first = vs.target_tokens(logits.clone(), info, reqs, paths, positions).tokens
    second = vs.target_tokens(logits.clone(), info, reqs, paths, positions).tokens
    checks = {
        "root and child of one verify": _independence_p(first[:, 0], first[:, 1]),
        "root in consecutive verifies": _independence_p(first[:, 0], second[:, 0]),
        "prefill and the next root": _independence_p(prefill, first[:, 0]),
    }
    assert min(checks.values()) > ALPHA, checks
