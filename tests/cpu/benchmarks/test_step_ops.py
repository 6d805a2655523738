# SPDX-License-Identifier: Apache-2.0
"""benchmarks/step_ops.py counts the real decode steps: DDTreeWorker's and upstream
DFlashWorkerV2's own ``forward_batch_generation`` with stand-in forwards, the real
overlay functions inside, the sglang-kernel accept path through a stand-in that
keeps the op's contract, and counts that are deterministic."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import step_ops
from sglang.srt.speculative.ddtree import accept
from sglang.srt.speculative.ddtree.tree_build import triton_interpreted
from sglang.srt.speculative.ddtree.tree_compile import compile_tree, max_tree_depth

pytestmark = pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1 before triton loads")

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
#: The pieces of a DDTREE step the count must go through (function names in the overlay / upstream).
DDTREE_SITES = ("build_tree", "_compile_triton", "_greedy_accept_kernel", "commit_accepted",
                "_prepare_dflash_draft_block_unchecked")  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_greedy_stand_in_keeps_the_kernel_contract(seed):
    """The stand-in read back by accept's kernel path equals accept's torch path."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ddtree_logic"))
    from _ddtree_helpers import random_tree

    rng = np.random.default_rng(seed)
    bs, budget, depths = 5, 24, 6
    tree = random_tree(rng, bs, budget, depths, vocab=4, pad_prob=0.3)
    ct = compile_tree(tree, torch.zeros(bs, dtype=torch.int64), torch.zeros(bs, dtype=torch.int64),
                      max_tree_depth(budget, depths))  # fmt: skip
    n = budget + 1
    pred = torch.from_numpy(rng.integers(0, 4, size=(bs, n)))
    want = accept.greedy_accept(ct, pred, use_kernel=False)
    predicts, accept_index, accept_num = accept._kernel_buffers(ct)
    step_ops.verify_tree_greedy_cpu(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=ct.tokens,
        retrive_index=ct.retrive_index, retrive_next_token=ct.retrive_next_token,
        retrive_next_sibling=ct.retrive_next_sibling, target_predict=pred,
    )  # fmt: skip
    got = accept.KernelAccept(predicts, accept_index, accept_num).to_result(ct.num_tokens)
    for name in ("accept_index", "num_accepted", "accept_tokens", "next_bonus"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert bool((want.num_accepted > 0).any())


@pytest.mark.parametrize("bs", [1, 8])
def test_ddtree_step_is_counted_through_its_real_pieces(bs):
    world = step_ops.StepWorld("DDTREE", bs, 16, 16, 256)
    before = world.worker.model_runner.req_to_token_pool.req_to_token.clone()
    first = world.count_step()
    second = step_ops.StepWorld("DDTREE", bs, 16, 16, 256).count_step()
    assert first == second  # deterministic
    sites = first["launches_by_site"]
    missing = [s for s in DDTREE_SITES if not any(k.endswith("." + s) for k in sites)]
    assert not missing, (missing, sites)
    # The per-depth top-K runs in the draft graph's replay (DraftTopKHead), not eagerly.
    assert not any(k.endswith(".lm_head_topk") for k in sites), sites
    assert first["extension_kernels"] == {"verify_tree_greedy": 1}
    assert set(first["triton_kernels"]) >= {"_ddtree_build_kernel", "_ddtree_compile_kernel", "_ddtree_commit_kernel"}
    assert first["stand_ins"]["draft_forward"] == 1 and first["stand_ins"]["target_verify_forward"] == 1
    # The steps permuted each request's tree window in req_to_token, losing no slot.
    after = world.worker.model_runner.req_to_token_pool.req_to_token
    assert torch.equal(after.flatten().sort().values, before.flatten().sort().values)


def test_dflash_step_runs_upstream_worker():
    counts = step_ops.StepWorld("DFLASH", 2, 0, 16, 256).count_step()
    assert set(counts["triton_kernels"]) == {
        "_prepare_dflash_draft_block_contig_kernel",
        "_dflash_accept_bonus_contig_kernel",
    }
    assert any(k.startswith("dflash_worker_v2.") for k in counts["launches_by_site"])


def test_committed_counts_are_the_code_and_below_the_baseline():
    """The committed run matches the code as it is, and stays below the baseline run."""
    after = json.loads((RESULTS / "step_ops_cpu_2026-12-02.json").read_text())
    base = {(r["algo"], r["bs"], r["budget"]): r for r in after["baseline"]["rows"]}
    row = next(r for r in after["rows"] if (r["algo"], r["bs"], r["budget"]) == ("DDTREE", 1, 16))
    now = step_ops.StepWorld("DDTREE", 1, 16, 16, 512).count_step()
    assert now["launches"] <= row["launches"]
    assert row["launches"] < base[("DDTREE", 1, 16)]["launches"]


class _RunAt:
    """A budget policy that runs every step at one budget (the policy is tested on its own)."""

    def __init__(self, budget):
        self.budget, self.asked, self.interruptions = budget, [], 0

    def choose(self, batch_size):
        self.asked.append(batch_size)
        return self.budget

    def interrupted(self):
        self.interruptions += 1


@pytest.mark.parametrize("step_budget", [1, 4, 16])
def test_a_step_below_the_full_budget(step_budget):
    """The worker's real step at the budget the policy picks: the first nodes of the tree,
    verified at that width (the scheduler reads the result with that stride), counted into
    that budget's statistics, the tree window permuted without losing a slot."""
    from sglang.srt.speculative.ddtree.metrics import DDTreeStepStats

    bs = 3
    world = step_ops.StepWorld("DDTREE", bs, 16, 16, 256)
    policy = _RunAt(step_budget)
    world.worker.budget_policy = policy
    world.worker.stats = DDTreeStepStats(16, interval=1 << 30, step_budgets=(1, 4, 16))
    before = world.worker.model_runner.req_to_token_pool.req_to_token.clone()
    with step_ops.gpu_accept_path(step_ops.StepOpCounter()):
        res = world.step()
    n = step_budget + 1
    assert policy.asked == [bs]
    assert res.speculative_num_draft_tokens == n and res.next_token_ids.numel() == bs * n
    assert bool(((res.accept_lens >= 1) & (res.accept_lens <= min(n, 16))).all())
    counts = world.worker.stats._counts
    ran = world.worker.stats.step_budgets.index(step_budget)
    assert int(counts[ran, 0].sum()) == bs and int(counts.sum()) == int(counts[ran].sum())
    assert int(counts[ran, 2, step_budget + 1 :].sum()) == 0  # no accepted node beyond the step's budget
    after = world.worker.model_runner.req_to_token_pool.req_to_token
    assert torch.equal(after.flatten().sort().values, before.flatten().sort().values)


@pytest.mark.parametrize("setting,extra", [("0.7/20/0.8", 3), ("0.7/20/0.8/0.05", 3), ("1", 1)])
def test_a_sampled_ddtree_step_draws_fused_in_a_few_launches(setting, extra):
    """Top-k with top-p: the verify draws every node with the fused draw (the candidates'
    top-k, the floors kernel, the Gumbel kernel and its seed, which a GPU host draws on its
    CPU), not the sampler's kernels (the stand-in sampler raises): the kernels read each
    request's parameters in place (none is copied per node, with or without min-p), so a
    sampled step launches three more than a greedy one, which takes one argmax instead;
    plain T=1 needs no floors, one more."""
    bs, vocab = 2, 256
    greedy = step_ops.StepWorld("DDTREE", bs, 16, 16, vocab).count_step()
    sampling = step_ops.Sampling.parse(setting)
    sampled = step_ops.StepWorld("DDTREE", bs, 16, 16, vocab, sampling=sampling).count_step()
    assert "_gumbel_draw_kernel" in sampled["triton_kernels"], sampled["triton_kernels"]
    filtered = sampling.top_k != step_ops.TOP_K_ALL
    assert ("_floors_kernel" in sampled["triton_kernels"]) == filtered
    assert sampled["ops"].get("device_ops:topk", 0) == greedy["ops"].get("device_ops:topk", 0) + filtered
    assert sampled["launches"] - greedy["launches"] == extra, (sampled["launches"], greedy["launches"])


def test_sampling_settings_parse():
    assert step_ops.Sampling.parse("0") is None
    assert step_ops.Sampling.parse("0.7/20/0.8/0.05") == step_ops.Sampling(0.7, 20, 0.8, 0.05)
    assert step_ops.Sampling.parse("1/0").top_k == step_ops.TOP_K_ALL
    with pytest.raises(ValueError):
        step_ops.Sampling.parse("1/2/3/4/5")
