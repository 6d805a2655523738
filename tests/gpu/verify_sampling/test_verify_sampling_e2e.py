# SPDX-License-Identifier: Apache-2.0
"""Sampling parameters through the real servers: DFLASH and DDTREE (B=16, 64; graphs and
overlap, and on the MLA pair also eager and synchronous) emit what the server without
speculation emits, on the MLA and the GQA test pair.

The test targets' greedy rule ``y[i+1] = tau(y[i-1])`` wins every step by ~20 logits, and a
prompt ``[.., p, tau^k(p)]`` makes the rule repeat an earlier output token k steps later. A
frequency, presence or repetition penalty on the repeat, with a logit bias that puts
replacement tokens 4 logits apart below the rule's winner, turns the repeat into a
replacement (and the rest of that chain into another orbit of the rule): an output that
depends on the penalties counting each node's own path, token by token, with clear margins. A logit
bias that makes EOS the winner everywhere shows ``min_new_tokens`` counted by depth.

On the GPU host after scripts/gpu_host/install.sh:
    source scripts/gpu_host/env.sh && python3 -m pytest tests/gpu/verify_sampling -q
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("GPU tier: needs a CUDA device", allow_module_level=True)

import urllib.error  # noqa: E402

from tests.gpu.verify_sampling._servers import SPECULATIVE, TARGETS  # noqa: E402

from tests.gpu.server_checks import models_manifest, rule_continuation  # noqa: E402

N = 64


def _prompts(tiny_models, n=4):
    """``[bos, 17, p, tau^k(p)]``: the rule's k-th output token repeats an earlier one (k = 1:
    the second output repeats the first, one depth apart inside the first tree)."""
    tau = models_manifest(tiny_models)["tau"]
    out = []
    for p, k in ((40, 1), (101, 2), (233, 3), (377, 1))[:n]:
        q = p
        for _ in range(k):
            q = tau[q]
        out.append([1, 17, p, q])
    return out


def _bias(tiny_models):
    """Replacement tokens 15, 11 and 7 logits above the rest: a repeat of the rule's winner (~20
    above the rest, ~10 after a repetition penalty of 2) loses to the first unused one."""
    tau = models_manifest(tiny_models)["tau"]
    picks = [t for t in range(300, 512) if t != tau[t]][:3]
    return {str(t): 15.0 - 4.0 * i for i, t in enumerate(picks)}


def _gen(server, ids, **sampling):
    out = server.generate_ids(ids, N, **sampling)
    return out["output_ids"]


def _refusal(server, payload) -> str:
    """The 400 a refused request gets, as text (fails if the request is served)."""
    try:
        out = server.post("/generate", payload)
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.code
        return e.read().decode(errors="replace")
    raise AssertionError(f"served instead of refused: {out}")


@pytest.mark.parametrize("target", ["mla", "qwen3"])
def test_greedy_with_a_repetition_penalty_is_the_targets_own(servers, tiny_models, target):
    """The rule's winner (~20 logits) at half after a repetition penalty of 2 loses to the
    first replacement token (15) by ~5; unpenalised it wins by ~5."""
    params = {"repetition_penalty": 2.0, "logit_bias": _bias(tiny_models)}
    ref = servers[(target, "nospec_sync")]
    changed = 0
    for ids in _prompts(tiny_models):
        want = _gen(ref, ids, **params)
        changed += want != rule_continuation(tiny_models, ids, N)
        for kind in SPECULATIVE[target]:
            got = _gen(servers[(target, kind)], ids, **params)
            first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
            assert got == want, f"{target} {kind}: first difference at token {first}"
    assert changed, "the penalty changed no output: the test would pass without it"


@pytest.mark.parametrize("target", ["mla", "qwen3"])
def test_min_new_tokens_counts_each_nodes_depth(servers, tiny_models, target):
    eos = json.loads((tiny_models / TARGETS[target][0] / "config.json").read_text())["eos_token_id"]
    ref = servers[(target, "nospec_sync")]
    for min_new in (1, 6, 23):
        params = {"logit_bias": {str(eos): 40.0}, "min_new_tokens": min_new, "ignore_eos": False}
        for ids in _prompts(tiny_models, 2):
            want = _gen(ref, ids, **params)
            assert len(want) <= min_new + 1  # EOS wins as soon as it may
            for kind in SPECULATIVE[target]:
                assert _gen(servers[(target, kind)], ids, **params) == want, (target, kind, min_new)


def test_sampling_masks_are_refused_per_request(servers, tiny_models):
    ids = _prompts(tiny_models, 1)[0]
    for kind in SPECULATIVE["mla"]:
        s = servers[("mla", kind)]
        msg = _refusal(s, {"input_ids": ids, "return_sampling_mask": True,
                           "sampling_params": {"temperature": 1.0, "max_new_tokens": 4}})
        assert "return_sampling_mask" in msg, (kind, msg)
        assert _gen(s, ids) == rule_continuation(tiny_models, ids, N)  # the server serves on


def test_overlap_scheduler_penalties_are_reported(servers, tiny_models):
    """Upstream's no-speculation server with the overlap scheduler feeds its penalizers the
    previous step's token a step late; reported, not asserted (it is upstream's behaviour)."""
    params = {"repetition_penalty": 2.0, "logit_bias": _bias(tiny_models)}
    same = sum(_gen(servers[("mla", "nospec")], ids, **params) == _gen(servers[("mla", "nospec_sync")], ids, **params)
               for ids in _prompts(tiny_models))
    print(f"\n[overlap-scheduled no-speculation server: {same}/4 penalised outputs equal the synchronous one]")


# ---------------------------------------------------------------------------------------------
# Seeds, on the learned pair (a target with real entropy) under --enable-deterministic-inference


def _pair_prompts(learned_pair, n):
    rows = [json.loads(line) for line in (learned_pair / "prompts.jsonl").read_text().splitlines() if line.strip()]
    return [r["prompt_ids"] for r in rows[:n]]


PAIR_PENALTIES = {
    "repetition": {"repetition_penalty": 1.3},
    "frequency": {"frequency_penalty": 1.0},
    "presence": {"presence_penalty": 1.0},
}
NEAR_TIE = 0.05  # nats: bf16 logits of a tree verify and a decode step may order such a pair apart


@pytest.mark.parametrize("penalty", list(PAIR_PENALTIES))
def test_greedy_with_penalties_on_the_learned_pair(all_servers, learned_pair, penalty):
    """Code text repeats tokens everywhere: penalties change most outputs. Every speculative
    output equals the synchronous no-speculation server's, except where the reference's own two
    best tokens (penalised, at that position) lie within ``NEAR_TIE``."""
    base = all_servers[("pair", "nospec_sync")]
    params = {"temperature": 0.0, "max_new_tokens": 80, "ignore_eos": True, **PAIR_PENALTIES[penalty]}
    changed, near_ties = 0, []
    for ids in _pair_prompts(learned_pair, 6):
        want = base.post("/generate", {"input_ids": ids, "sampling_params": params})["output_ids"]
        plain = base.post("/generate", {"input_ids": ids, "sampling_params": {
            **params, **{k: (1.0 if k == "repetition_penalty" else 0.0) for k in PAIR_PENALTIES[penalty]}}})
        changed += plain["output_ids"] != want
        for kind in SPECULATIVE["pair"]:
            got = all_servers[("pair", kind)].post("/generate", {"input_ids": ids, "sampling_params": params})
            got = got["output_ids"]
            if got == want:
                continue
            j = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            out = base.post("/generate", {"input_ids": ids, "sampling_params": {**params, "max_new_tokens": j + 1},
                                          "return_logprob": True, "top_logprobs_num": 2})  # fmt: skip
            (lp1, t1, *_), (lp2, t2, *_) = out["meta_info"]["output_top_logprobs"][j][:2]
            assert lp1 - lp2 < NEAR_TIE and got[j] in (t1, t2), (
                f"{kind} {penalty}: differs at token {j} ({got[j]} for {want[j]}), margin {lp1 - lp2:.3f} nats")
            near_ties.append((kind, j, round(lp1 - lp2, 4)))
    assert changed >= 3, f"the {penalty} penalty changed only {changed} of 6 outputs"
    for kind in SPECULATIVE["pair"]:
        assert sum(k == kind for k, _, _ in near_ties) <= 2, near_ties
    print(f"\n[{penalty}: {changed}/6 outputs changed by the penalty; near ties: {near_ties}]")


def test_seeded_sampling_repeats_and_follows_the_seeded_target(all_servers, learned_pair):
    """A seed gives the same output run after run. Against the seeded server without
    speculation the output is the same until one draw's two best Gumbel-perturbed scores lie
    closer than bf16 rounding of the verify's logits: on this target ~15 tokens on average,
    where unseeded draws agree on about one (each token a fresh draw of the target)."""
    params = {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "max_new_tokens": 48, "ignore_eos": True}
    base = all_servers[("pair", "nospec_sync")]
    agree = {}
    for kind in SPECULATIVE["pair"]:
        s = all_servers[("pair", kind)]
        agree[kind] = []
        for i, ids in enumerate(_pair_prompts(learned_pair, 8)):
            p = {**params, "sampling_seed": 1000 + i}
            first = s.post("/generate", {"input_ids": ids, "sampling_params": p})["output_ids"]
            again = s.post("/generate", {"input_ids": ids, "sampling_params": p})["output_ids"]
            assert first == again, f"{kind}: seed {1000 + i} gave two outputs"
            want = base.post("/generate", {"input_ids": ids, "sampling_params": p})["output_ids"]
            agree[kind].append(next((j for j, (a, b) in enumerate(zip(want, first)) if a != b), len(want)))
        # Each node is drawn at its own position with the request's seed: the seeded target's
        # tokens, up to a draw that bf16 rounding of the verify's logits tips.
        assert sum(agree[kind]) / len(agree[kind]) >= 8, (kind, agree[kind])
    print(f"\n[tokens equal to the seeded no-speculation output, per prompt: {agree}]")


def test_min_p_with_seeds_is_refused(all_servers, learned_pair):
    ids = _pair_prompts(learned_pair, 1)[0]
    msg = _refusal(all_servers[("pair", "ddtree16")], {"input_ids": ids, "sampling_params": {
        "temperature": 1.0, "min_p": 0.1, "sampling_seed": 3, "max_new_tokens": 4}})
    assert "min_p" in msg and "deterministic" in msg, msg
