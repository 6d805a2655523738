# SPDX-License-Identifier: Apache-2.0
"""The real patched ServerArgs accepts DDTREE and refuses what it cannot serve.

No GPU is faked: ``device="cuda"`` is passed explicitly, which is all the
speculative startup checks look at; ServerArgs resolves on a CPU machine.
"""

import argparse

import pytest

from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.ddtree import budget

# Must match conftest.py's tiny configs.
VOCAB = 512
DRAFT_BLOCK = 16


def _make(model_dirs, target="mla", **kw):
    kw.setdefault("speculative_draft_model_path", model_dirs["draft"])
    return ServerArgs(
        model_path=model_dirs[target],
        speculative_algorithm=kw.pop("speculative_algorithm", "DDTREE"),
        device="cuda",
        skip_tokenizer_init=True,
        **kw,
    )


def test_defaults(model_dirs):
    sa = _make(model_dirs)
    assert sa.speculative_algorithm == "DDTREE"
    # The auto budget policy: adaptive over B=64, verify graphs at 16 as well.
    assert sa.speculative_ddtree_budget_policy == "adaptive"
    assert sa.speculative_ddtree_budget == 64
    assert sa.speculative_ddtree_graph_budgets == "16"
    assert sa.speculative_ddtree_topk == min(64, VOCAB)
    # Verify width is the tree (budget + root); the draft block stays DFlash's.
    assert sa.speculative_num_draft_tokens == 64 + 1
    assert sa.speculative_dflash_block_size == DRAFT_BLOCK
    assert sa.speculative_num_steps == 1
    assert sa.speculative_eagle_topk == 1
    assert sa.page_size == 1
    assert sa.attention_backend == "triton"


def test_lowercase_name_and_explicit_flags(model_dirs):
    sa = _make(
        model_dirs,
        speculative_algorithm="ddtree",
        speculative_ddtree_budget=32,
        speculative_ddtree_topk=4,
        speculative_num_draft_tokens=33,
    )
    assert sa.speculative_algorithm == "DDTREE"
    assert (sa.speculative_ddtree_budget, sa.speculative_ddtree_topk) == (32, 4)
    assert sa.speculative_num_draft_tokens == 33


def test_tree_source_flag(model_dirs):
    assert _make(model_dirs).speculative_ddtree_tree == "marginals"
    assert _make(model_dirs, speculative_ddtree_tree="transitions").speculative_ddtree_tree == "transitions"
    with pytest.raises(ValueError, match=r"--speculative-ddtree-tree must be one of marginals, transitions, got 'selector'"):
        _make(model_dirs, speculative_ddtree_tree="selector")


def test_budget_policy_flag(model_dirs):
    assert _make(model_dirs, speculative_ddtree_budget=16).speculative_ddtree_budget_policy == "fixed"
    sa = _make(model_dirs, speculative_ddtree_budget=64, speculative_ddtree_budget_policy="adaptive")
    # The graphs, the KV headroom and the verify buffers are sized for the full budget.
    assert (sa.speculative_ddtree_budget_policy, sa.speculative_num_draft_tokens) == ("adaptive", 65)
    with pytest.raises(ValueError, match=r"--speculative-ddtree-budget-policy must be one of fixed, adaptive, auto, got 'per-step'"):
        _make(model_dirs, speculative_ddtree_budget_policy="per-step")
    with pytest.raises(ValueError, match="with --tp-size 2 the ranks would choose apart"):
        _make(model_dirs, speculative_ddtree_budget_policy="adaptive", tp_size=2)
    assert _make(model_dirs, tp_size=2, speculative_ddtree_budget_policy="fixed").speculative_ddtree_budget == 16


def test_graph_budgets_flag(model_dirs):
    adaptive = dict(speculative_ddtree_budget=64, speculative_ddtree_budget_policy="adaptive")
    assert _make(model_dirs, **adaptive).speculative_ddtree_graph_budgets is None
    sa = _make(model_dirs, speculative_ddtree_graph_budgets=" 16, 4,16", **adaptive)
    # Normalised; the verify width, the KV headroom and the main graphs stay the full budget's.
    assert (sa.speculative_ddtree_graph_budgets, sa.speculative_num_draft_tokens) == ("4,16", 65)
    tree = budget.TreeBudget.of(sa)
    assert (tree.budget, tree.graph_budgets) == (64, (4, 16))
    assert tree.at(16).graph_budgets == (4,) and tree.at(4).graph_budgets == ()
    for value, message in (("64", r"must lie in \[1, 63\] .* got 64"), ("0", r"got 0"),
                           ("16;4", "takes comma-separated integers, got '16;4'")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            _make(model_dirs, speculative_ddtree_graph_budgets=value, **adaptive)
    with pytest.raises(ValueError, match="Add --speculative-ddtree-budget-policy adaptive, or remove it"):
        _make(model_dirs, speculative_ddtree_budget=64, speculative_ddtree_graph_budgets="16")
    with pytest.raises(ValueError, match="captures CUDA graphs, which --disable-cuda-graph turns off"):
        _make(model_dirs, speculative_ddtree_graph_budgets="16", disable_cuda_graph=True, **adaptive)
    with pytest.raises(ValueError, match="--enable-lora keeps once per process"):
        _make(model_dirs, speculative_ddtree_graph_budgets="16", enable_lora=True, max_lora_rank=8,
              lora_target_modules=["q_proj"], **adaptive)  # fmt: skip


def _budget_policy(sa):
    return (sa.speculative_ddtree_budget_policy, sa.speculative_ddtree_budget, sa.speculative_ddtree_graph_budgets,
            sa.speculative_num_draft_tokens)  # fmt: skip


def test_auto_budget_policy(model_dirs, monkeypatch):
    """``auto`` resolves at start-up into the policy the worker runs: adaptive over B=64 with
    verify graphs at 16 where one process serves a dense target with CUDA graphs, else a fixed
    budget; a given budget or graph budget is kept."""
    from sglang.srt.speculative.ddtree import flags

    auto = dict(speculative_ddtree_budget_policy="auto")
    assert (flags.AUTO_BUDGET, flags.AUTO_GRAPH_BUDGET) == (64, 16)
    for target in ("mla", "mha"):
        assert _budget_policy(_make(model_dirs, target=target, **auto)) == ("adaptive", 64, "16", 65)
    assert _budget_policy(_make(model_dirs, speculative_ddtree_budget=32, **auto)) == ("adaptive", 32, "16", 33)
    assert _budget_policy(_make(model_dirs, speculative_ddtree_graph_budgets="8,16", **auto)) == ("adaptive", 64, "8,16", 65)
    tree = budget.TreeBudget.of(_make(model_dirs, **auto))
    assert (tree.budget, tree.graph_budgets, tree.verify_width) == (64, (16,), 65)
    # No graph budget below the given budget: a fixed budget, not eager smaller ones.
    assert _budget_policy(_make(model_dirs, speculative_ddtree_budget=16, **auto)) == ("fixed", 16, None, 17)
    # What rules out the adaptive policy or a second set of graphs: the default budget, fixed.
    for extra in (dict(disable_cuda_graph=True), dict(tp_size=2),
                  dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"])):  # fmt: skip
        assert _budget_policy(_make(model_dirs, **auto, **extra)) == ("fixed", budget.DEFAULT_BUDGET, None, 17), extra
    assert _budget_policy(_make(model_dirs, speculative_ddtree_budget=48, tp_size=2, **auto)) == ("fixed", 48, None, 49)
    with pytest.raises(ValueError, match="--tp-size 2 rule out the adaptive policy with verify graphs. Remove it"):
        _make(model_dirs, speculative_ddtree_graph_budgets="16", tp_size=2, **auto)
    # Statistics off: the adaptive policy has no accept lengths to rank the budgets by.
    monkeypatch.setenv("SGLANG_DDTREE_STATS_INTERVAL", "0")
    assert _budget_policy(_make(model_dirs, **auto)) == ("fixed", budget.DEFAULT_BUDGET, None, 17)


def test_default_budget_policy(model_dirs, monkeypatch):
    """With neither flag the server runs ``DEFAULT_BUDGET_POLICY``; a budget given alone is a
    fixed budget whatever the default (the override a user reaches for)."""
    from sglang.srt.speculative.ddtree import flags

    assert flags.DEFAULT_BUDGET_POLICY == "auto"
    assert _budget_policy(_make(model_dirs)) == ("adaptive", 64, "16", 65)
    assert _budget_policy(_make(model_dirs, speculative_ddtree_budget=32)) == ("fixed", 32, None, 33)
    assert _budget_policy(_make(model_dirs, tp_size=2)) == ("fixed", budget.DEFAULT_BUDGET, None, 17)
    monkeypatch.setattr(flags, "DEFAULT_BUDGET_POLICY", "fixed")
    assert _budget_policy(_make(model_dirs)) == ("fixed", budget.DEFAULT_BUDGET, None, budget.DEFAULT_BUDGET + 1)


def test_auto_budget_policy_on_a_hybrid_target(model_dirs):
    """A linear-attention hybrid keeps a recurrent state per tree node: auto runs the fixed
    default budget there."""
    # Without the overlap scheduler: with it upstream's mamba radix strategy asserts a CUDA device.
    hybrid = dict(target="hybrid", speculative_ddtree_budget_policy="auto", attention_backend="triton",
                  disable_overlap_schedule=True)  # fmt: skip
    sa = _make(model_dirs, **hybrid)
    assert _budget_policy(sa) == ("fixed", budget.DEFAULT_BUDGET, None, budget.DEFAULT_BUDGET + 1)
    with pytest.raises(ValueError, match="a target with linear-attention layers rule out"):
        _make(model_dirs, speculative_ddtree_graph_budgets="4", **hybrid)


def test_small_budget_truncates_draft_block(model_dirs):
    # A tree of 4 nodes is at most 4 deep: the drafter runs [bonus, MASK x 4].
    sa = _make(model_dirs, speculative_ddtree_budget=4)
    assert sa.speculative_num_draft_tokens == 5
    assert sa.speculative_dflash_block_size == 5
    assert sa.speculative_ddtree_topk == 4


def test_max_budget_and_topk_bounded_by_vocab(model_dirs):
    sa = _make(model_dirs, speculative_ddtree_budget=256)
    assert sa.speculative_num_draft_tokens == 257
    assert sa.speculative_ddtree_topk == 256


def test_flashinfer_allowed_for_mha(model_dirs):
    sa = _make(model_dirs, target="mha", attention_backend="flashinfer")
    assert sa.attention_backend == "flashinfer"


def test_flashinfer_mla_needs_the_tree_verify_hook(model_dirs, monkeypatch):
    # Served by the fork's tree-verify hook (tree_mask_bits) ...
    sa = _make(model_dirs, attention_backend="flashinfer")
    assert sa.attention_backend == "flashinfer"
    # ... which the upstream-strategy switch turns off: FlashInfer MLA has no mask.
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_STRATEGY", "upstream_extend")
    with pytest.raises(ValueError, match="needs the tree-verify hook"):
        _make(model_dirs, attention_backend="flashinfer")
    # Triton keeps working on its dense-mask path.
    assert _make(model_dirs).attention_backend == "triton"


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(speculative_ddtree_budget=0), r"budget must be in \[1, 256\], got 0"),
        (dict(speculative_ddtree_budget=257), r"budget must be in \[1, 256\], got 257"),
        (dict(speculative_ddtree_budget=64, speculative_ddtree_topk=0), r"topk .* must be in \[1, 64\], got 0"),
        (dict(speculative_ddtree_budget=64, speculative_ddtree_topk=65), r"topk .* must be in \[1, 64\], got 65"),
        (
            dict(speculative_ddtree_budget=8, speculative_ddtree_topk=9),
            r"topk .* must be in \[1, 8\], got 9",
        ),
        (
            dict(speculative_ddtree_budget=64, speculative_num_draft_tokens=16),
            r"--speculative-num-draft-tokens is the verify width .* = 65\), got 16",
        ),
        (dict(page_size=16), r"requires --page-size 1"),
        (dict(attention_backend="fa3"), r"verify backend 'fa3' has none for MLA models"),
        (
            dict(prefill_attention_backend="flashmla", decode_attention_backend="triton"),
            r"verify backend 'flashmla' has none",
        ),
        (dict(speculative_draft_window_size=64), r"does not support --speculative-draft-window-size"),
        (dict(speculative_draft_model_path=None), r"requires setting --speculative-draft-model-path"),
    ],
)
def test_refused_at_startup(model_dirs, kw, message):
    with pytest.raises(ValueError, match=message):
        _make(model_dirs, **kw)


def _resolved(sa):
    return (
        sa.speculative_ddtree_budget, sa.speculative_ddtree_topk, sa.speculative_num_draft_tokens,
        sa.speculative_dflash_block_size, sa.get_attention_backends(), sa.speculative_draft_attention_backend,
        sa.page_size,
    )  # fmt: skip


@pytest.mark.parametrize("target", ["mla", "mha"])
def test_tensor_parallel_resolves_as_one_gpu(model_dirs, target):
    """Tensor parallelism changes nothing DDTREE resolves (the tree, the draft block,
    the verify and draft backends) and keeps its refusals; TP-2 ran the DDTREE GPU
    suite on a two-GPU H200 host (2026-11-30)."""
    kw = dict(attention_backend="flashinfer") if target == "mha" else {}
    one = _make(model_dirs, target, speculative_ddtree_budget=32, **kw)
    two = _make(model_dirs, target, speculative_ddtree_budget=32, tp_size=2, **kw)
    assert _resolved(two) == _resolved(one)
    assert _resolved(two)[:4] == (32, 32, 33, DRAFT_BLOCK)
    with pytest.raises(ValueError, match="requires --page-size 1"):
        _make(model_dirs, target, tp_size=2, page_size=16, **kw)


@pytest.mark.parametrize("algorithm", ["DFLASH", None])
@pytest.mark.parametrize(
    "kw,flags_named",
    [
        (dict(speculative_ddtree_budget=999), "--speculative-ddtree-budget only apply"),
        (dict(speculative_ddtree_topk=-5), "--speculative-ddtree-topk only apply"),
        (dict(speculative_ddtree_tree="transitions"), "--speculative-ddtree-tree only apply"),
        (dict(speculative_ddtree_budget_policy="adaptive"), "--speculative-ddtree-budget-policy only apply"),
        (dict(speculative_ddtree_graph_budgets="16"), "--speculative-ddtree-graph-budgets only apply"),
        (dict(speculative_ddtree_budget=999, speculative_ddtree_topk=-5),
         "--speculative-ddtree-budget and --speculative-ddtree-topk only apply"),
    ],
)  # fmt: skip
def test_ddtree_flags_without_ddtree_are_refused(model_dirs, algorithm, kw, flags_named):
    running = "--speculative-algorithm DFLASH" if algorithm else "no speculative decoding"
    args = dict(speculative_algorithm=algorithm, **kw)
    if algorithm is None:
        args["speculative_draft_model_path"] = None
    with pytest.raises(ValueError, match=f"{flags_named} to --speculative-algorithm DDTREE, but this server runs {running}"):
        _make(model_dirs, **args)


def test_cli_ddtree_flags_with_dflash_are_refused(model_dirs):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args([
        "--model-path", model_dirs["mla"], "--speculative-algorithm", "dflash",
        "--speculative-draft-model-path", model_dirs["draft"], "--speculative-ddtree-budget", "999",
        "--device", "cuda", "--skip-tokenizer-init",
    ])  # fmt: skip
    with pytest.raises(ValueError, match="Remove it, or pass --speculative-algorithm DDTREE"):
        ServerArgs.from_cli_args(args)


def test_cli_flags_parse(model_dirs):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--model-path",
            model_dirs["mla"],
            "--speculative-algorithm",
            "DDTREE",
            "--speculative-draft-model-path",
            model_dirs["draft"],
            "--speculative-ddtree-budget",
            "16",
            "--speculative-ddtree-topk",
            "3",
            "--speculative-ddtree-tree",
            "transitions",
            "--speculative-ddtree-budget-policy",
            "adaptive",
            "--speculative-ddtree-graph-budgets",
            "4",
            "--device",
            "cuda",
            "--skip-tokenizer-init",
        ]
    )
    sa = ServerArgs.from_cli_args(args)
    assert (sa.speculative_ddtree_budget, sa.speculative_ddtree_topk, sa.speculative_ddtree_tree) == (16, 3, "transitions")
    assert (sa.speculative_ddtree_budget_policy, sa.speculative_ddtree_graph_budgets) == ("adaptive", "4")
    assert sa.speculative_num_draft_tokens == 17


def test_dflash_unchanged(model_dirs):
    # The DDTREE flags are inert for DFLASH: its verify width is the block.
    sa = _make(model_dirs, speculative_algorithm="DFLASH")
    assert sa.speculative_num_draft_tokens == DRAFT_BLOCK
    assert sa.speculative_ddtree_budget is None


@pytest.mark.parametrize("bad", [True, 1.5, "8"])
def test_budget_type_checked(bad):
    with pytest.raises(ValueError, match="must be an integer"):
        budget.TreeBudget.resolve(bad, None, 16, 512)
