# SPDX-License-Identifier: Apache-2.0
"""The generated test models load as ordinary HF checkpoints and behave as constructed.

The targets are run through transformers' own DeepseekV2 / Qwen3 / Qwen3-Next
modelling code (not ours), and the drafter through a plain torch forward written
from upstream's ``sglang/srt/models/dflash.py`` semantics, using transformers' RoPE.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_test_models", REPO / "scripts" / "make_test_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    manifest = gen.generate(out, seed=0)
    return out, manifest


def _target(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_dirs_load_with_transformers(models):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    out, manifest = models
    for name in ("tiny-mla", "tiny-qwen3", "tiny-qwen3next", "tiny-gptoss", "v2lite-shape", "qwen3-8b-shape",
                 "qwen36-a3b-shape"):
        cfg = AutoConfig.from_pretrained(str(out / name))
        tok = AutoTokenizer.from_pretrained(str(out / name))
        assert tok.convert_tokens_to_ids("<|MASK|>") == manifest["mask_token_id"]
        assert len(tok) == gen.VOCAB <= cfg.vocab_size
        text = tok.apply_chat_template([{"role": "user", "content": "bako"}], tokenize=False, add_generation_prompt=True)
        assert text.startswith("<|bos|><|user|>") and text.endswith("<|assistant|>")
    assert AutoConfig.from_pretrained(str(out / "tiny-mla")).kv_lora_rank == 512
    assert AutoConfig.from_pretrained(str(out / "tiny-mla")).qk_rope_head_dim == 64
    for name in ("tiny-mla-dflash", "tiny-qwen3-dflash", "tiny-qwen3next-dflash", "tiny-gptoss-dflash",
                 "v2lite-shape-dflash", "qwen3-8b-shape-dflash", "qwen36-a3b-shape-dflash"):
        cfg = json.loads((out / name / "config.json").read_text())
        target = json.loads((out / name.replace("-dflash", "") / "config.json").read_text())
        assert cfg["architectures"] == ["DFlashDraftModel"]
        assert cfg["hidden_size"] == target["hidden_size"]
        ids = cfg["dflash_config"]["target_layer_ids"]
        # DeepSeek captures layer i's output at the input of layer i + 1.
        assert max(ids) < target["num_hidden_layers"] - 1
    # Weight shapes match the drafter config (what upstream's loader checks).
    cfg = json.loads((out / "tiny-mla-dflash" / "config.json").read_text())
    with safe_open(str(out / "tiny-mla-dflash" / "model.safetensors"), "pt") as f:
        assert f.get_slice("fc.weight").get_shape() == [cfg["hidden_size"], 2 * cfg["hidden_size"]]
        hd, nh = cfg["head_dim"], cfg["num_attention_heads"]
        assert f.get_slice("layers.1.self_attn.q_proj.weight").get_shape() == [nh * hd, cfg["hidden_size"]]
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    # transformers loads the targets with no missing or unexpected weights.
    from transformers import AutoModelForCausalLM

    for name in ("tiny-mla", "tiny-qwen3", "tiny-qwen3next", "tiny-gptoss"):
        _, info = AutoModelForCausalLM.from_pretrained(str(out / name), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-qwen3", "tiny-qwen3next", "tiny-gptoss"])
def test_target_greedy_rule_and_margin(models, name):
    out, manifest = models
    tau = torch.tensor(manifest["tau"])
    model = _target(out / name)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(gen.NUM_SPECIAL, gen.VOCAB, (3, 400), generator=g)
    ids[:, 0] = 1  # <|bos|>
    ids[0, 10:20] = torch.arange(5, 15)  # specials inside a prompt keep the rule too
    ids[0, 14] = 20
    with torch.no_grad():
        logits = model(ids).logits.float()
    top2 = logits.topk(2, dim=-1)
    assert torch.equal(top2.indices[:, 1:, 0], tau[ids[:, :-1]])
    margin = top2.values[:, 1:, 0] - top2.values[:, 1:, 1]
    assert margin.min() > 10.0, margin.min()
    # Greedy continuations are long and do not collapse into a repeated token.
    cont = gen.Codes.greedy_from(manifest["tau"], [1, 40, 41], 64)
    assert len(set(cont)) >= 32 and all(cont[i] != cont[i + 1] or cont[i] != cont[i + 2] for i in range(62))


def test_previous_token_heads_peak_over_the_whole_context(models):
    """The layer-0 RoPE scores stay >= 20 below the distance-1 peak up to max positions."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    out, _ = models
    w = load_file(str(out / "tiny-mla" / "model.safetensors"))
    cfg = json.loads((out / "tiny-mla" / "config.json").read_text())
    rope, nope = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"]
    x_u = gen.rms_scale(3.0)
    k_pe = w["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"][512:, gen.U].float() * x_u
    q_pe = w["model.layers.0.self_attn.q_proj.weight"][nope : nope + rope, gen.U].float() * x_u
    n = cfg["max_position_embeddings"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, rope, 2).float() / rope))
    freqs = torch.polar(torch.ones(n, rope // 2), torch.outer(torch.arange(n).float(), inv))
    q = q_pe.expand(1, 1, n, rope)
    k = k_pe.expand(1, 1, n, rope)
    qr, kr = apply_rotary_emb(q, k, freqs.unsqueeze(0))
    scores = (kr[0, 0] @ qr[0, 0, -1]) * (nope + rope) ** -0.5  # query at the last position
    delta = torch.arange(n - 1, -1, -1)
    peak = scores[delta == 1]
    rest = scores[delta != 1]
    assert float(peak - rest.max()) > 20.0


def _ref_draft_offsets(out: Path, name: str, prompt: torch.Tensor, bonus: int):
    """Greedy draft tokens for block offsets 1..15 (a plain-torch DFlash forward)."""
    from safetensors.torch import load_file
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    tgt = _target(out / name)
    dcfg = json.loads((out / f"{name}-dflash" / "config.json").read_text())
    dw = {k: v.float() for k, v in load_file(str(out / f"{name}-dflash" / "model.safetensors")).items()}
    eps = dcfg["rms_norm_eps"]
    hd, nh, nkv = dcfg["head_dim"], dcfg["num_attention_heads"], dcfg["num_key_value_heads"]
    bsz = dcfg["block_size"]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x, pos):  # x [T, heads, hd]
        inv = 1.0 / (dcfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.outer(pos.float(), inv)
        emb = torch.cat([ang, ang], -1)
        xt = x.transpose(0, 1)[None]  # [1, heads, T, hd], the layout transformers expects
        out_q, _ = apply_rotary_pos_emb(xt, xt, emb.cos()[None], emb.sin()[None], unsqueeze_dim=1)
        return out_q[0].transpose(0, 1)

    with torch.no_grad():
        hs = tgt(prompt[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1][0] for i in dcfg["dflash_config"]["target_layer_ids"]], -1)
        ctx = rms(feats @ dw["fc.weight"].T, dw["hidden_norm.weight"])
        n = prompt.numel()
        block = torch.full((bsz,), gen.MASK_ID)
        block[0] = bonus
        x = tgt.get_input_embeddings()(block)
        pos_ctx, pos_blk = torch.arange(n), torch.arange(n, n + bsz)
        residual = x
        h = x
        for layer in range(dcfg["num_hidden_layers"]):
            p = f"layers.{layer}."
            hn = rms(residual, dw[p + "input_layernorm.weight"])

            def proj(inp, which):
                return inp @ dw[p + f"self_attn.{which}_proj.weight"].T

            q = rms(proj(hn, "q").view(bsz, nh, hd), dw[p + "self_attn.q_norm.weight"])
            k_blk = rms(proj(hn, "k").view(bsz, nkv, hd), dw[p + "self_attn.k_norm.weight"])
            k_ctx = rms(proj(ctx, "k").view(n, nkv, hd), dw[p + "self_attn.k_norm.weight"])
            v = torch.cat([proj(ctx, "v"), proj(hn, "v")]).view(n + bsz, nkv, hd)
            k = torch.cat([rope(k_ctx, pos_ctx), rope(k_blk, pos_blk)])
            q = rope(q, pos_blk)
            att = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5  # non-causal (ENCODER_ONLY)
            o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(bsz, nh * hd)
            residual = residual + o @ dw[p + "self_attn.o_proj.weight"].T
            hn = rms(residual, dw[p + "post_attention_layernorm.weight"])
            gate, up = hn @ dw[p + "mlp.gate_proj.weight"].T, hn @ dw[p + "mlp.up_proj.weight"].T
            residual = residual + (torch.nn.functional.silu(gate) * up) @ dw[p + "mlp.down_proj.weight"].T
        h = rms(residual, dw["norm.weight"])
        logits = h @ tgt.lm_head.weight.float().T
    return logits[1:]  # offsets 1..15


@pytest.mark.parametrize("name", ["tiny-mla", "tiny-qwen3", "tiny-qwen3next", "tiny-gptoss"])
def test_drafter_predicts_the_target_continuation(models, name):
    out, manifest = models
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(gen.NUM_SPECIAL, gen.VOCAB, (57,), generator=g)
    prompt[0] = 1
    tau = manifest["tau"]
    bonus = tau[int(prompt[-2])]  # the target's next token after the prompt
    truth = gen.Codes.greedy_from(tau, prompt.tolist() + [bonus], gen.BLOCK_SIZE - 1)
    logits = _ref_draft_offsets(out, name, prompt, bonus)
    top2 = logits.topk(2, dim=-1).indices
    for k in range(1, gen.BLOCK_SIZE):
        if k == manifest["decoy_offset"]:
            assert top2[k - 1, 0] != truth[k - 1] and top2[k - 1, 1] == truth[k - 1]
        else:
            assert top2[k - 1, 0] == truth[k - 1], (k, top2[k - 1].tolist(), truth[k - 1])


def test_hybrid_target_reads_the_previous_token_from_the_recurrent_state(models):
    """The hybrid target's rule goes through layer 0's Gated DeltaNet state: with
    the state after the previous token the next token follows the rule; with no
    state, or with the state one token older (what a node would get from its
    grandparent instead of its parent), it does not, and neither with a stale
    conv window. Decoded one token at a time through transformers' cache."""
    import copy

    out, manifest = models
    tau = manifest["tau"]
    model = _target(out / "tiny-qwen3next")
    g = torch.Generator().manual_seed(3)
    trials, broken = 20, {"no state": 0, "older state": 0, "older conv window": 0}
    for _ in range(trials):
        prompt = torch.randint(gen.NUM_SPECIAL, gen.VOCAB, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g)
        prompt[0] = 1
        want = tau[int(prompt[-2])]
        with torch.no_grad():
            cache = model(prompt[None, :-1], use_cache=True).past_key_values
            older = model(prompt[None, :-2], use_cache=True).past_key_values

            def next_token(edit=None):
                c = copy.deepcopy(cache)
                if edit is not None:
                    edit(c.layers[0])
                return int(model(prompt[None, -1:], past_key_values=c, use_cache=True).logits[0, -1].argmax())

            assert next_token() == want
            broken["no state"] += next_token(lambda s: s.recurrent_states.zero_()) != want
            broken["older state"] += next_token(lambda s: s.recurrent_states.copy_(older.layers[0].recurrent_states)) != want
            broken["older conv window"] += next_token(lambda s: s.conv_states.copy_(older.layers[0].conv_states)) != want
    # A token whose row repeats the previous one's is stored by its own write: the
    # state does not matter for it, which random prompts hit now and then.
    assert all(n >= trials - 2 for n in broken.values()), broken


def test_gptoss_target_needs_its_window_and_its_sinks(models):
    """The sliding-window + sink target through transformers' GptOss code: the rule
    holds with the configured window and sinks; a window one key wider (or none)
    lets the far heads' token win, a narrower one changes nothing, and dropping the
    sinks of either layer kind breaks the rule."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out, manifest = models
    path = str(out / "tiny-gptoss")
    tau = torch.tensor(manifest["tau"])
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(gen.NUM_SPECIAL, gen.VOCAB, (2, 200), generator=g)
    ids[:, 0] = 1

    def rule_rate(layer_sinks=None, **config):
        cfg = AutoConfig.from_pretrained(path)
        for key, value in config.items():
            setattr(cfg, key, value)
        model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for layer in layer_sinks or ():
                model.model.layers[layer].self_attn.sinks.fill_(-1e4)
            top = model(ids).logits.argmax(-1)
        return float((top[:, gen.SLIDING_WINDOW : -1] == tau[ids[:, gen.SLIDING_WINDOW - 1 : -2]]).float().mean())

    cfg = json.loads((out / "tiny-gptoss" / "config.json").read_text())
    assert cfg["sliding_window"] == gen.SLIDING_WINDOW and cfg["layer_types"][0] == "sliding_attention"
    assert rule_rate() == 1.0
    assert rule_rate(sliding_window=gen.SLIDING_WINDOW - 1) == 1.0
    assert rule_rate(sliding_window=gen.SLIDING_WINDOW + 1) < 0.1
    assert rule_rate(layer_types=["full_attention"] * cfg["num_hidden_layers"]) < 0.1
    assert rule_rate(layer_sinks=[0]) < 0.5  # the far heads copy what they see
    assert rule_rate(layer_sinks=[1]) < 0.1  # the full layer's sink head writes its fixed code


def test_generation_is_deterministic(models, tmp_path):
    out, _ = models
    gen.generate(tmp_path, seed=0, which=("mla",))
    for sub in ("tiny-mla", "tiny-mla-dflash"):
        a = hashlib.sha256((out / sub / "model.safetensors").read_bytes()).hexdigest()
        b = hashlib.sha256((tmp_path / sub / "model.safetensors").read_bytes()).hexdigest()
        assert a == b, sub


@pytest.mark.parametrize(
    "name,arch,layers,kv_per_token_layer",
    [("v2lite-shape", "MLA", 27, 512 + 64),  # one latent per token and layer
     ("qwen3-8b-shape", "MHA", 36, 2 * 8 * 128),  # K and V of 8 KV heads
     ("gptoss-20b-shape", "MHA", 24, 2 * 8 * 64)],  # the same in both of its pools
)  # fmt: skip
def test_shape_pairs_read_by_sglang(models, name, arch, layers, kv_per_token_layer):
    """The config-only pairs are what sglang's own ModelConfig sees for the real models:
    the attention kind, layers and KV width that size the KV pools, and a DFlash drafter
    that sglang's parser accepts for that target."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    out, manifest = models
    assert manifest["models"][name] == {"target": name, "drafter": f"{name}-dflash", "load_format": "dummy"}
    target = ModelConfig(model_path=str(out / name))
    drafter = ModelConfig(model_path=str(out / f"{name}-dflash"), is_draft_model=True)
    assert target.attention_arch == getattr(AttentionArch, arch)
    assert target.num_hidden_layers == layers
    width = (
        target.kv_lora_rank + target.qk_rope_head_dim
        if arch == "MLA"
        else target.get_total_num_kv_heads() * (target.head_dim + target.v_head_dim)
    )
    assert width == kv_per_token_layer
    assert drafter.attention_arch == AttentionArch.MHA and drafter.get_total_num_kv_heads() >= 4
    parsed = parse_dflash_draft_config(draft_hf_config=drafter.hf_config)
    assert parsed.require_num_layers() == 5 == drafter.num_hidden_layers
    assert parsed.resolve_block_size(default=None) == gen.BLOCK_SIZE
    ids = parsed.resolve_target_layer_ids(target_num_layers=layers, draft_num_layers=5)
    assert len(ids) == 5 and max(ids) < layers - 1


def test_partial_generation_keeps_the_manifest_complete(tmp_path):
    """``--only`` into an existing set (as tests/gpu/hybrid does for an older set)
    adds its pairs to manifest.json instead of dropping the others'."""
    gen.generate(tmp_path, seed=0, which=("shapes",))
    manifest = gen.generate(tmp_path, seed=0, which=("hybrid-shapes",))
    assert set(manifest["models"]) == {"v2lite-shape", "qwen3-8b-shape", "qwen36-a3b-shape"}
    assert json.loads((tmp_path / "manifest.json").read_text())["models"] == manifest["models"]
    other_seed = gen.generate(tmp_path, seed=1, which=("hybrid-shapes",))
    assert set(other_seed["models"]) == {"qwen36-a3b-shape"}  # another seed's tau: nothing kept
