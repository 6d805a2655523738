#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generate the seeded, offline test models for the GPU end-to-end tests.

Random weights give degenerate text and a drafter that never agrees with its
target, so the tiny models here are *constructed*: every weight that decides a
greedy token is placed by hand, the rest is small seeded noise, and the result
is an ordinary HF checkpoint (safetensors + config + tokenizer) that upstream
SGLang loads through its normal code paths.

The greedy rule of the tiny targets is ``y[i+1] = tau(y[i-1])``: in the MLA and
Qwen3 targets layer 0 has two attention heads whose RoPE queries/keys peak
sharply at relative distance 1 and copy the previous token's code, and the LM
head maps that code through the signed permutation ``tau``.  Attention
therefore decides every token (a wrong KV slot or a wrong mask changes the
output), and every greedy step wins by a wide logit margin (about 20), so
greedy output is numerically stable across attention backends.  In the hybrid
Qwen3-Next target the previous token's code comes through layer 0's Gated
DeltaNet instead, read from its recurrent state (``qwen3next_target``).  ``tau`` has one long cycle, so continuations are long and
non-repeating.

The DFlash drafter predicts block offset ``k`` as ``tau^ceil(k/2)`` of the last
committed token (odd ``k``) or of the bonus token (even ``k``).  Its layer 1
turns each MASK position's offset into a one-hot (RoPE heads peaked at the
bonus distance), layer 2 uses that one-hot to aim one head per offset at the
right source token and maps its code through ``tau^m``.  At depth 5 the drafter
is deliberately wrong (its top-1 is a decoy, the right token is its top-2), so
the chain stops there while a tree with two branches goes on.

Outputs (``OUTDIR/<name>``):
  tiny-mla, tiny-mla-dflash        DeepSeek-V2 MLA target and its DFlash drafter
  tiny-qwen3, tiny-qwen3-dflash    Qwen3 (GQA) target and its DFlash drafter
  tiny-mla-dflash2, tiny-qwen3-dflash2  DFlash 2 drafters of the same two targets
                                   (``dflash2_drafter``)
  tiny-qwen3-dflash2-unsupported   a DFlash 2 drafter the server must refuse at start-up
  tiny-qwen3next, tiny-qwen3next-dflash  Qwen3-Next hybrid (Gated DeltaNet) target
                                   whose linear-attention layer carries the rule
  tiny-gptoss, tiny-gptoss-dflash  gpt-oss target (sliding windows of 8, attention
                                   sinks) whose sliding layer carries the rule
  v2lite-shape, v2lite-shape-dflash  config-only, for ``--load-format dummy``
  qwen3-8b-shape, qwen3-8b-shape-dflash  config-only (Qwen3-8B, GQA), likewise
  qwen36-a3b-shape, qwen36-a3b-shape-dflash  config-only, Qwen3.6-35B-A3B's text stack
  gptoss-20b-shape, gptoss-20b-shape-dflash  config-only, gpt-oss-20b (sliding windows, sinks)
  manifest.json                    the construction facts tests rely on
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

# ----------------------------------------------------------------------------
# Vocabulary and residual-stream layout shared by every tiny model.

SPECIAL_TOKENS = [
    "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>", "<|MASK|>", "<|system|>",
    "<|user|>", "<|assistant|>", "<|end|>",
] + [f"<|reserved_{i}|>" for i in range(7)]
NUM_SPECIAL = len(SPECIAL_TOKENS)  # 16
MASK_ID = SPECIAL_TOKENS.index("<|MASK|>")
VOCAB = 512
NUM_ROWS = (VOCAB - NUM_SPECIAL) // 2  # 248 code rows, each used with both signs
CODE_DIM = 256
HIDDEN = 768
MAX_POS = 4096
ROPE_THETA = 10000.0
BLOCK_SIZE = 16
DECOY_OFFSET = 5  # the drafter's top-1 is wrong at this block offset

A = slice(0, 256)  # code of the current token
B = slice(256, 512)  # code copied from the previous token (what the LM head reads)
U, N_TOK, M_MASK, C_CTX, SP = 512, 513, 514, 515, 516  # marker dimensions
O_BASE = 520  # offset one-hot written by drafter layer 1: dims O_BASE + k
# dims 536.. carry only noise

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|> {{ message['content'] }} <|end|> "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def words(rng: np.random.Generator) -> list[str]:
    """496 distinct two-syllable words for the normal tokens."""
    syl = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    all_words = sorted({a + b for a in syl for b in syl})
    pick = rng.choice(len(all_words), size=VOCAB - NUM_SPECIAL, replace=False)
    return [all_words[i] for i in sorted(pick)]


def hadamard(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


class Codes:
    """Token codes and the signed permutation ``tau`` acting on them.

    Normal token ``16 + r + 248*s`` has code ``(-1)^s * h[r+1] / 16`` (rows of a
    256 Hadamard matrix): any two codes are orthogonal or antipodal, so a logit
    read through a code is exactly +1, -1 or 0 times its scale.  ``tau`` maps
    row r to row rho(r) with sign eps[r]; it is linear on codes (``matrix``).
    Special tokens reuse the code of one normal token (scaled by 1/sqrt 2).
    """

    def __init__(self, rng: np.random.Generator):
        h = hadamard(CODE_DIM) / math.sqrt(CODE_DIM)
        self.rows = h[1 : NUM_ROWS + 1]  # [248, 256], orthonormal
        cycle = rng.permutation(NUM_ROWS)
        self.rho = np.empty(NUM_ROWS, dtype=np.int64)
        self.rho[cycle] = np.roll(cycle, -1)  # a single 248-cycle
        self.eps = rng.choice([-1.0, 1.0], size=NUM_ROWS)
        self.special_alias = {t: NUM_SPECIAL + 3 * t for t in range(NUM_SPECIAL) if t != MASK_ID}
        # Decoy map for the drafter's wrong depth: a signed shift, no fixed row.
        self.decoy_rho = (np.arange(NUM_ROWS) + 1) % NUM_ROWS
        self.decoy_eps = rng.choice([-1.0, 1.0], size=NUM_ROWS)

    @staticmethod
    def row_sign(tok: int) -> tuple[int, float]:
        i = tok - NUM_SPECIAL
        return i % NUM_ROWS, (-1.0 if i >= NUM_ROWS else 1.0)

    @staticmethod
    def token(row: int, sign: float) -> int:
        return NUM_SPECIAL + row + (NUM_ROWS if sign < 0 else 0)

    def code(self, tok: int) -> np.ndarray:
        if tok < NUM_SPECIAL:
            if tok == MASK_ID:
                return np.zeros(CODE_DIM)
            return self.code(self.special_alias[tok]) / math.sqrt(2.0)
        r, s = self.row_sign(tok)
        return s * self.rows[r]

    def tau(self, tok: int) -> int:
        """The target's greedy rule: y[i+1] = tau(y[i-1])."""
        if tok < NUM_SPECIAL:
            return self.tau(self.special_alias[tok]) if tok != MASK_ID else -1
        r, s = self.row_sign(tok)
        return self.token(int(self.rho[r]), s * self.eps[r])

    def _perm_matrix(self, rho, eps, power: int) -> np.ndarray:
        m = np.eye(CODE_DIM)
        step = np.eye(CODE_DIM) - self.rows.T @ self.rows  # rows outside the code set stay
        step = step + (self.rows[rho].T * eps) @ self.rows
        for _ in range(power):
            m = step @ m
        return m

    def matrix(self, power: int) -> np.ndarray:
        """Linear map sending code(t) to code(tau^power(t))."""
        return self._perm_matrix(self.rho, self.eps, power)

    def decoy_matrix(self) -> np.ndarray:
        return self._perm_matrix(self.decoy_rho, self.decoy_eps, 1)

    @staticmethod
    def greedy_from(tau: list[int], prompt: list[int], n: int) -> list[int]:
        """The target's greedy continuation of ``prompt`` (tau as a table)."""
        seq = list(prompt)
        for _ in range(n):
            seq.append(tau[seq[-2]])
        return seq[len(prompt) :]


# ----------------------------------------------------------------------------
# RoPE heads that look at one relative distance.


def rope_freqs(dim: int, theta: float = ROPE_THETA) -> np.ndarray:
    return theta ** (-np.arange(dim // 2) * 2.0 / dim)


def peak_amplitudes(omegas: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative pair weights A (sum 1) maximising min_x f(0) - f(x).

    f(x) = sum_i A_i cos(w_i x); an attention score built from these pairs
    peaks at the wanted distance and stays ``margin`` below it at every other
    distance in ``offsets`` (a linear program).
    """
    from scipy.optimize import linprog

    n = len(omegas)
    gap = 1.0 - np.cos(np.outer(offsets, omegas))
    c = np.zeros(n + 1)
    c[-1] = -1.0
    res = linprog(
        c,
        A_ub=np.hstack([-gap, np.ones((len(offsets), 1))]),
        b_ub=np.zeros(len(offsets)),
        A_eq=np.hstack([np.ones((1, n)), np.zeros((1, 1))]),
        b_eq=[1.0],
        bounds=[(0, None)] * n + [(None, None)],
        method="highs",
    )
    if not res.success:
        raise RuntimeError(f"positional LP failed: {res.message}")
    return np.clip(res.x[:n], 0, None), float(res.x[-1])


def pair_index(i: int, dim: int, neox: bool) -> tuple[int, int]:
    return (i, i + dim // 2) if neox else (2 * i, 2 * i + 1)


def positional_qk(amps, omegas, peak: int, dim: int, neox: bool):
    """Query/key vectors with q . R(delta) k = sum_i amps_i cos(w_i (delta - peak)).

    delta = query position - key position; both vectors have norm sqrt(sum amps).
    """
    q, k = np.zeros(dim), np.zeros(dim)
    for i, (a, w) in enumerate(zip(amps, omegas)):
        x, y = pair_index(i, dim, neox)
        r = math.sqrt(a)
        k[x] = r
        q[x], q[y] = r * math.cos(peak * w), -r * math.sin(peak * w)
    return q, k


def const_pair(i: int, dim: int, neox: bool) -> np.ndarray:
    """Unit vector on a low-frequency pair: nearly position-independent."""
    v = np.zeros(dim)
    v[pair_index(i, dim, neox)[0]] = 1.0
    return v


def unit(v):
    return v / np.linalg.norm(v)


# ----------------------------------------------------------------------------
# Tokenizer


def save_tokenizer(out: Path, vocab_words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + vocab_words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        unk_token="<|unk|>",
        pad_token="<|pad|>",
        mask_token="<|MASK|>",
        model_max_length=MAX_POS,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


# ----------------------------------------------------------------------------
# Weight construction helpers


class Weights(dict):
    def __init__(self, rng: np.random.Generator, noise: float):
        super().__init__()
        self.rng, self.noise = rng, noise

    def rand(self, name, shape, std=None):
        std = self.noise if std is None else std
        self[name] = self.rng.standard_normal(shape) * std
        return self[name]

    def ones(self, name, n, value=1.0):
        self[name] = np.full(n, value)
        return self[name]


def embeddings(codes: Codes) -> np.ndarray:
    """Every embedding has norm sqrt(3), so RMSNorm scales all tokens alike."""
    emb = np.zeros((VOCAB, HIDDEN))
    for t in range(VOCAB):
        emb[t, U] = 1.0
        if t == MASK_ID:
            emb[t, M_MASK] = math.sqrt(2.0)
            continue
        emb[t, N_TOK] = 1.0
        emb[t, A] = codes.code(t)  # specials: an alias code scaled by 1/sqrt2 ...
        if t < NUM_SPECIAL:
            emb[t, SP] = 1.0 / math.sqrt(2.0)  # ... plus a marker, keeping norm sqrt3
    return emb


# Output projections of the noise paths are this much smaller than their inputs,
# so the residual stream carries about 0.1 of noise next to unit-norm codes.
OUT_NOISE = 0.05
LOGIT_SCALE = 1.45  # LM head gain: the greedy logit margin is about 20


def lm_head(codes: Codes) -> np.ndarray:
    head = np.zeros((VOCAB, HIDDEN))
    for s in range(NUM_SPECIAL, VOCAB):
        r, sign = Codes.row_sign(s)
        # preimage of s under tau
        src_row = int(np.nonzero(codes.rho == r)[0][0])
        src_sign = sign * codes.eps[src_row]
        head[s, B] = LOGIT_SCALE * src_sign * codes.rows[src_row]
    return head


def rms_scale(norm_sq: float) -> float:
    """Factor RMSNorm applies to a hidden vector of the given squared norm."""
    return math.sqrt(HIDDEN / norm_sq)


# ----------------------------------------------------------------------------
# Targets


MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
TARGET_LAYERS = 4
TARGET_LAYER_IDS = [0, 2]  # DFlash features; DeepSeek needs ids < num_layers - 1
PREV_MARGIN = 24.0  # score gap of the previous-token heads
PREV_OFFSETS = np.array([-1] + list(range(1, MAX_POS)))  # delta - 1 for delta != 1


def mla_target(codes: Codes, rng: np.random.Generator, noise: float):
    H, nh = HIDDEN, 16
    nope, rope, vd, lora = (MLA[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))
    qk = nope + rope
    scaling = qk**-0.5
    w = Weights(rng, noise)
    emb = embeddings(codes)
    w["model.embed_tokens.weight"] = emb
    x_u = rms_scale(3.0)  # U coordinate after the first RMSNorm

    omegas = rope_freqs(rope)
    amps, frac = peak_amplitudes(omegas, PREV_OFFSETS)
    amps = amps * (PREV_MARGIN / frac) / scaling
    q_pe, k_pe = positional_qk(amps, omegas, peak=1, dim=rope, neox=False)

    for layer in range(TARGET_LAYERS):
        p = f"model.layers.{layer}."
        w.ones(p + "input_layernorm.weight", H)
        w.ones(p + "post_attention_layernorm.weight", H)
        w.ones(p + "self_attn.kv_a_layernorm.weight", lora)
        q = w.rand(p + "self_attn.q_proj.weight", (nh * qk, H))
        kva = w.rand(p + "self_attn.kv_a_proj_with_mqa.weight", (lora + rope, H))
        kvb = w.rand(p + "self_attn.kv_b_proj.weight", (nh * (nope + vd), lora))
        o = w.rand(p + "self_attn.o_proj.weight", (H, nh * vd), std=noise * OUT_NOISE)
        if layer == 0:
            # Heads 0 and 1 attend to distance 1 and copy the code into B.
            kva[lora:, :] = 0.0
            kva[lora:, U] = k_pe / x_u
            kva[:CODE_DIM, :] = 0.0
            kva[:CODE_DIM, A] = np.eye(CODE_DIM)
            c_kv_gain = math.sqrt(lora / CODE_DIM)  # kv_a_layernorm rescales the code
            for h in range(2):
                rows = slice(h * qk, (h + 1) * qk)
                q[rows, :] = 0.0
                q[h * qk + nope : (h + 1) * qk, U] = q_pe / x_u
                kv_rows = h * (nope + vd)
                kvb[kv_rows : kv_rows + nope, :] = 0.0
                kvb[kv_rows + nope : kv_rows + nope + vd, :] = 0.0
                kvb[kv_rows + nope : kv_rows + nope + vd, h * vd : (h + 1) * vd] = np.eye(vd) / c_kv_gain
                o[:, h * vd : (h + 1) * vd] = 0.0
                o[B.start + h * vd : B.start + (h + 1) * vd, h * vd : (h + 1) * vd] = np.eye(vd) / math.sqrt(CODE_DIM)
        if layer < TARGET_LAYERS - 1:
            w.rand(p + "mlp.gate_proj.weight", (512, H))
            w.rand(p + "mlp.up_proj.weight", (512, H))
            w.rand(p + "mlp.down_proj.weight", (H, 512), std=noise * OUT_NOISE)
        else:  # last layer: a small MoE, as in DeepSeek-V2
            w.rand(p + "mlp.gate.weight", (8, H), std=0.5)
            for e in range(8):
                w.rand(p + f"mlp.experts.{e}.gate_proj.weight", (128, H))
                w.rand(p + f"mlp.experts.{e}.up_proj.weight", (128, H))
                w.rand(p + f"mlp.experts.{e}.down_proj.weight", (H, 128), std=noise * OUT_NOISE)
            w.rand(p + "mlp.shared_experts.gate_proj.weight", (128, H))
            w.rand(p + "mlp.shared_experts.up_proj.weight", (128, H))
            w.rand(p + "mlp.shared_experts.down_proj.weight", (H, 128), std=noise * OUT_NOISE)
    w.ones("model.norm.weight", H)
    w["lm_head.weight"] = lm_head(codes)
    config = deepseek_v2_config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS, num_attention_heads=nh, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=TARGET_LAYERS - 1, max_position_embeddings=MAX_POS,
        rope_theta=ROPE_THETA, rope_scaling=None,
    )  # fmt: skip
    return w, config


def qwen3_target(codes: Codes, rng: np.random.Generator, noise: float):
    """GQA target: kv heads 0/1 hold the positional key and the code halves."""
    H, nh, nkv, hd = HIDDEN, 8, 4, 128
    w = Weights(rng, noise)
    w["model.embed_tokens.weight"] = embeddings(codes)
    x_u, x_a = rms_scale(3.0), rms_scale(3.0)
    omegas = rope_freqs(hd)
    amps, frac = peak_amplitudes(omegas, PREV_OFFSETS)
    norm_gain = 3.0  # q_norm/k_norm weight: unit directions become norm 3*sqrt(128)
    unit_score = norm_gain**2 * hd * hd**-0.5
    qv, kv = positional_qk(amps, omegas, peak=1, dim=hd, neox=True)  # unit norm (sum amps = 1)
    if unit_score * frac < PREV_MARGIN:
        raise RuntimeError("qwen3 previous-token head margin too small")
    for layer in range(TARGET_LAYERS):
        p = f"model.layers.{layer}."
        w.ones(p + "input_layernorm.weight", H)
        w.ones(p + "post_attention_layernorm.weight", H)
        w.ones(p + "self_attn.q_norm.weight", hd, norm_gain)
        w.ones(p + "self_attn.k_norm.weight", hd, norm_gain)
        q = w.rand(p + "self_attn.q_proj.weight", (nh * hd, H))
        k = w.rand(p + "self_attn.k_proj.weight", (nkv * hd, H))
        v = w.rand(p + "self_attn.v_proj.weight", (nkv * hd, H))
        o = w.rand(p + "self_attn.o_proj.weight", (H, nh * hd), std=noise * OUT_NOISE)
        if layer == 0:
            for g in range(2):  # kv head g serves query heads 2g (copy) and 2g+1 (noise)
                kr = slice(g * hd, (g + 1) * hd)
                k[kr, :] = 0.0
                k[kr, U] = kv / x_u
                v[kr, :] = 0.0
                v[kr, A.start + g * hd : A.start + (g + 1) * hd] = np.eye(hd) / x_a
                qh = 2 * g
                q[qh * hd : (qh + 1) * hd, :] = 0.0
                q[qh * hd : (qh + 1) * hd, U] = qv / x_u
                o[:, qh * hd : (qh + 1) * hd] = 0.0
                o[B.start + g * hd : B.start + (g + 1) * hd, qh * hd : (qh + 1) * hd] = np.eye(hd)
        w.rand(p + "mlp.gate_proj.weight", (512, H))
        w.rand(p + "mlp.up_proj.weight", (512, H))
        w.rand(p + "mlp.down_proj.weight", (H, 512), std=noise * OUT_NOISE)
    w.ones("model.norm.weight", H)
    w["lm_head.weight"] = lm_head(codes)
    config = qwen3_config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=512, num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, max_position_embeddings=MAX_POS,
        rope_theta=ROPE_THETA,
    )  # fmt: skip
    return w, config


# ----------------------------------------------------------------------------
# Hybrid target: Gated DeltaNet (linear attention) + gated full attention


GDN_KERNEL = 4  # causal conv width
GDN_DECAY = 0.1  # exp(g): the share of the state a step keeps
GDN_ANCHOR = GDN_DECAY / 6  # query weight on the current token's own write
GDN_QK_GAIN, GDN_V_GAIN, GDN_Z, GDN_B = 0.25, 16.0, 4.0, 10.0
GDN_OUT = 1.6  # norm of what layer 0 writes into B


def qwen3next_target(codes: Codes, rng: np.random.Generator, noise: float):
    """Qwen3-Next layout [GDN, attention, GDN, attention], every MLP a small MoE.

    Layer 0's Gated DeltaNet carries the rule: one head with 256-dim keys, so
    every token code is its own key. Keys and values are the current token's
    code, so the delta rule stores each token under its own code; the query
    is the *previous* token's code (the causal conv's previous tap) plus
    ``GDN_ANCHOR`` times the current one. The state decays by ``GDN_DECAY`` a
    step, so the read returns the previous token's code at ``GDN_DECAY`` next
    to the current token's at ``GDN_ANCHOR`` (its write of this step). Both
    land in B, where the previous token's wins by 6:1 and the LM head maps it
    through ``tau``. A state that is not the one after the previous
    token (missing it, or holding it decayed once more) lets the current
    token's code win, and a wrong conv window reads the wrong previous token:
    either changes the output. The attention layers and layer 2 are noise.
    """
    H, E = HIDDEN, 4
    nh, nkv, hd = 4, 2, 128
    kd = vd = CODE_DIM
    w = Weights(rng, noise)
    w["model.embed_tokens.weight"] = embeddings(codes)
    x_u = x_a = rms_scale(3.0)  # layer 0 sees the embeddings
    silu_z = GDN_Z / (1.0 + math.exp(-GDN_Z))
    h0 = np.ones(CODE_DIM) / math.sqrt(CODE_DIM)  # Hadamard row 0, which no token uses
    layer_types = hybrid_layer_types(TARGET_LAYERS, full_attention_interval=2)
    for layer, kind in enumerate(layer_types):
        p = f"model.layers.{layer}."
        w.ones(p + "input_layernorm.weight", H, 0.0)  # Qwen3-Next norms scale by 1 + weight
        w.ones(p + "post_attention_layernorm.weight", H, 0.0)
        if kind == "linear_attention":
            a = p + "linear_attn."
            qkvz = w.rand(a + "in_proj_qkvz.weight", (2 * kd + 2 * vd, H))
            ba = w.rand(a + "in_proj_ba.weight", (2, H))
            conv = w.rand(a + "conv1d.weight", (2 * kd + vd, 1, GDN_KERNEL))
            out = w.rand(a + "out_proj.weight", (H, vd), std=noise * OUT_NOISE)
            w.ones(a + "norm.weight", vd)
            if layer == 0:
                qkvz[:] = 0.0
                q, k, v, z = (slice(i * kd, (i + 1) * kd) for i in range(4))
                qkvz[q, A] = GDN_QK_GAIN * np.eye(kd) / x_a
                qkvz[k, A] = GDN_QK_GAIN * np.eye(kd) / x_a
                qkvz[v, A] = GDN_V_GAIN * np.eye(vd) / x_a
                qkvz[z, U] = GDN_Z / x_u
                ba[:] = 0.0
                ba[0, U] = GDN_B / x_u  # beta = sigmoid(b) ~ 1; the decay input a stays 0
                conv[:] = 0.0
                conv[q, 0, GDN_KERNEL - 2] = 1.0  # the previous token
                conv[q, 0, GDN_KERNEL - 1] = GDN_ANCHOR  # the current token
                conv[k, 0, GDN_KERNEL - 1] = 1.0
                conv[2 * kd :, 0, GDN_KERNEL - 1] = 1.0  # values: the current token
                out[B, :] = GDN_OUT * (np.eye(vd) - np.outer(h0, h0)) / (math.sqrt(vd) * silu_z)
                w["model.layers.0.linear_attn.A_log"] = np.zeros(1)
                w["model.layers.0.linear_attn.dt_bias"] = np.full(1, math.log(1.0 / GDN_DECAY - 1.0))
            else:
                w[a + "A_log"] = np.zeros(1)
                w[a + "dt_bias"] = np.zeros(1)
        else:
            a = p + "self_attn."
            w.rand(a + "q_proj.weight", (2 * nh * hd, H))
            w.rand(a + "k_proj.weight", (nkv * hd, H))
            w.rand(a + "v_proj.weight", (nkv * hd, H))
            w.rand(a + "o_proj.weight", (H, nh * hd), std=noise * OUT_NOISE)
            w.ones(a + "q_norm.weight", hd, 0.0)
            w.ones(a + "k_norm.weight", hd, 0.0)
        w.rand(p + "mlp.gate.weight", (E, H), std=0.5)
        for e in range(E):
            w.rand(p + f"mlp.experts.{e}.gate_proj.weight", (128, H))
            w.rand(p + f"mlp.experts.{e}.up_proj.weight", (128, H))
            w.rand(p + f"mlp.experts.{e}.down_proj.weight", (H, 128), std=noise * OUT_NOISE)
        w.rand(p + "mlp.shared_expert.gate_proj.weight", (128, H))
        w.rand(p + "mlp.shared_expert.up_proj.weight", (128, H))
        w.rand(p + "mlp.shared_expert.down_proj.weight", (H, 128), std=noise * OUT_NOISE)
        w.rand(p + "mlp.shared_expert_gate.weight", (1, H))
    w.ones("model.norm.weight", H, 0.0)
    w["lm_head.weight"] = lm_head(codes)
    config = qwen3_next_config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=512, num_hidden_layers=TARGET_LAYERS,
        full_attention_interval=2, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
        linear_conv_kernel_dim=GDN_KERNEL, linear_key_head_dim=kd, linear_value_head_dim=vd,
        linear_num_key_heads=1, linear_num_value_heads=1, num_experts=E, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=128, max_position_embeddings=MAX_POS,
        rope_theta=ROPE_THETA,
    )  # fmt: skip
    return w, config


# ----------------------------------------------------------------------------
# Sliding-window + attention-sink target (gpt-oss architecture)


SLIDING_WINDOW = 8  # HF's sliding_window (the query's own token included): keys at distance <= 7
SINK_GAP = 12.0  # the far heads' sink sits this far below their peak score
FAR_GAIN = 2.0  # a far head that sees its token outweighs the previous-token code
SINKED_SINK, SINKED_GAIN = 20.0, 3.0  # layer 1's sink head: its sink, and its output if the sink is lost
GPTOSS_EXPERTS = 4


def gptoss_target(codes: Codes, rng: np.random.Generator, noise: float):
    """gpt-oss layout: [sliding, full, sliding, full] attention with learned sinks,
    every MLP a small MoE (GptOssExperts), 16 query and 8 KV heads of 64.

    Layer 0 (sliding, ``SLIDING_WINDOW`` - 1 = 7 keys back) carries the rule: kv
    heads 0-3 serve *previous-token* heads (distance 1, one 64-dim quarter of the
    code each, copied into B); kv heads 4-7 serve *far* heads, which peak at
    distance ``SLIDING_WINDOW``, just outside the window, and would add
    ``FAR_GAIN`` times that token's code to B. Inside a correct window the far key
    is hidden and the far heads' sinks (``SINK_GAP`` below the peak, above every
    other key) take their attention, so they write nothing. So: a window one key
    too wide lets the far token win; a window counted by a tree node's index
    instead of its depth hides the node's parent from the previous-token heads;
    sinks that are dropped let the far heads copy whatever is visible. Layer 1
    (full) has a head with a zero query and a sink of ``SINKED_SINK``: with the
    sink its output vanishes, without it the head adds ``SINKED_GAIN`` times a fixed
    code to B and every token becomes the same one. The rest is seeded noise.
    """
    H, nh, nkv, hd, inter, E = HIDDEN, 16, 8, 64, 128, GPTOSS_EXPERTS
    scaling = hd**-0.5
    w = Weights(rng, noise)
    w["model.embed_tokens.weight"] = embeddings(codes)
    x_u = x_a = rms_scale(3.0)  # layer 0 sees the embeddings
    x_u1 = rms_scale(4.0)  # layer 1 sees them plus the copied code
    omegas = rope_freqs(hd)
    amps, frac = peak_amplitudes(omegas, PREV_OFFSETS)
    amps = amps * (PREV_MARGIN / frac) / scaling  # peak score PREV_MARGIN / frac, the rest >= PREV_MARGIN below
    peak_score = PREV_MARGIN / frac
    q_prev, k_pos = positional_qk(amps, omegas, peak=1, dim=hd, neox=True)
    q_far, k_far = positional_qk(amps, omegas, peak=SLIDING_WINDOW, dim=hd, neox=True)
    assert np.allclose(k_pos, k_far)  # one positional key serves both peaks
    sinked_code = codes.rows[0]
    layer_types = ["sliding_attention", "full_attention"] * (TARGET_LAYERS // 2)
    for layer in range(TARGET_LAYERS):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        w.ones(p + "input_layernorm.weight", H)
        w.ones(p + "post_attention_layernorm.weight", H)
        q = w.rand(a + "q_proj.weight", (nh * hd, H))
        k = w.rand(a + "k_proj.weight", (nkv * hd, H))
        v = w.rand(a + "v_proj.weight", (nkv * hd, H))
        o = w.rand(a + "o_proj.weight", (H, nh * hd), std=noise * OUT_NOISE)
        for name, n in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd), ("o_proj", H)):
            w.ones(a + f"{name}.bias", n, 0.0)
        sinks = w.rand(a + "sinks", nh, std=1.0)
        if layer == 0:
            for g in range(nkv):
                far, chunk = g >= 4, g % 4
                kr = slice(g * hd, (g + 1) * hd)
                k[kr, :] = 0.0
                k[kr, U] = k_pos / x_u
                v[kr, :] = 0.0
                v[kr, A.start + chunk * hd : A.start + (chunk + 1) * hd] = np.eye(hd) / x_a
                for h in (2 * g, 2 * g + 1):  # the kv head's two query heads
                    q[h * hd : (h + 1) * hd, :] = 0.0
                    o[:, h * hd : (h + 1) * hd] = 0.0
                h = 2 * g
                q[h * hd : (h + 1) * hd, U] = (q_far if far else q_prev) / x_u
                gain = FAR_GAIN if far else 1.0
                o[B.start + chunk * hd : B.start + (chunk + 1) * hd, h * hd : (h + 1) * hd] = gain * np.eye(hd)
                sinks[h] = peak_score - SINK_GAP if far else 0.0
        elif layer == 1:
            # Query head 0 (kv head 0): zero query, so every key scores 0 against the sink.
            q[0:hd, :] = 0.0
            v[0:hd, :] = 0.0
            v[0, U] = 1.0 / x_u1
            o[:, 0 : 2 * hd] = 0.0  # head 1 shares that value: silenced
            o[B, 0] = SINKED_GAIN * sinked_code
            sinks[0] = SINKED_SINK
        w.rand(p + "mlp.router.weight", (E, H), std=0.5)
        w.ones(p + "mlp.router.bias", E, 0.0)
        w.rand(p + "mlp.experts.gate_up_proj", (E, H, 2 * inter))
        w[p + "mlp.experts.gate_up_proj_bias"] = np.zeros((E, 2 * inter))
        w.rand(p + "mlp.experts.down_proj", (E, inter, H), std=noise * OUT_NOISE)
        w[p + "mlp.experts.down_proj_bias"] = np.zeros((E, H))
    w.ones("model.norm.weight", H)
    w["lm_head.weight"] = lm_head(codes)
    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": VOCAB,
        "hidden_size": H,
        "intermediate_size": inter,
        "num_hidden_layers": TARGET_LAYERS,
        "layer_types": layer_types,
        "sliding_window": SLIDING_WINDOW,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "num_local_experts": E,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "swiglu_limit": 7.0,
        "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POS,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
        "rms_norm_eps": 1e-6,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    return w, config


# ----------------------------------------------------------------------------
# DFlash drafter


DRAFT_HEADS, DRAFT_HD = 32, 128
# Low-frequency RoPE pairs used as position-independent content channels.
PAIR_MASK, PAIR_CTX, PAIR_BONUS = 61, 62, 63
POS_PAIRS = 60


def dflash_drafter(codes: Codes, target_cfg: dict, rng: np.random.Generator, noise: float):
    H, nh, hd = HIDDEN, DRAFT_HEADS, DRAFT_HD
    neox = True
    w = Weights(rng, noise)
    omegas = rope_freqs(hd)
    e_mask, e_ctx, e_bonus = (const_pair(i, hd, neox) for i in (PAIR_MASK, PAIR_CTX, PAIR_BONUS))

    # Target feature 0 (output of target layer 0) is u + n + code + copied code;
    # fc keeps the code and turns u into the context marker.
    fc = w.rand("fc.weight", (H, 2 * H), std=noise / 8)
    fc[A, A] = np.eye(CODE_DIM)
    fc[C_CTX, U] = 1.0
    w.ones("hidden_norm.weight", H)
    w.ones("norm.weight", H)
    x_blk = rms_scale(3.0)  # bonus / MASK coordinates after layer-1 input norm
    x_ctx = rms_scale(2.0)  # context coordinates after hidden_norm

    # ---- layer 1: offset detector. Head j attends to the bonus iff offset == j.
    amps1, frac1 = peak_amplitudes(omegas[:POS_PAIRS], np.array([x for x in range(-15, 16) if x]))
    gain1 = 2.7
    u1 = gain1**2 * math.sqrt(hd)  # score of two aligned post-norm unit vectors
    alpha, mu = 60.0 / u1, 47.0 / u1
    if 60.0 * frac1 < 18.0 or alpha**2 + mu**2 >= 1.0:
        raise RuntimeError("drafter layer-1 margins do not fit")
    gamma = math.sqrt(1.0 - alpha**2 - mu**2)
    p = "layers.0."
    q = w.rand(p + "self_attn.q_proj.weight", (nh * hd, H))
    k = w.rand(p + "self_attn.k_proj.weight", (nh * hd, H))
    v = w.rand(p + "self_attn.v_proj.weight", (nh * hd, H))
    o = w.rand(p + "self_attn.o_proj.weight", (H, nh * hd), std=noise * OUT_NOISE)
    o[O_BASE : O_BASE + BLOCK_SIZE, :] = 0.0
    for j in range(1, BLOCK_SIZE):
        rows = slice(j * hd, (j + 1) * hd)
        qpos, kpos = positional_qk(amps1, omegas[:POS_PAIRS], peak=j, dim=hd, neox=neox)
        q[rows, :] = 0.0
        q[rows, U] = (alpha * qpos + mu * e_mask - gamma * e_ctx) / x_blk
        k[rows, :] = 0.0
        k[rows, N_TOK] = kpos / x_blk
        k[rows, M_MASK] = e_mask / (x_blk * math.sqrt(2.0))
        k[rows, C_CTX] = e_ctx / x_ctx
        v[rows, :] = 0.0
        v[j * hd, N_TOK] = 1.0 / x_blk
        o[:, rows] = 0.0
        o[O_BASE + j, j * hd] = 1.0
    _draft_layer_common(w, p, gain1)

    # ---- layer 2: per offset, one pair of heads copies the source code through tau^m.
    amps2, frac2 = peak_amplitudes(omegas[:POS_PAIRS], np.arange(1, MAX_POS + BLOCK_SIZE))
    gain2 = 3.3
    u2 = gain2**2 * math.sqrt(hd)
    pos_share, ctx_share = 0.95, math.sqrt(1 - 0.95**2)
    if u2 * 0.9 * pos_share * frac2 < 20.0:
        raise RuntimeError("drafter layer-2 context margin too small")
    p = "layers.1."
    q = w.rand(p + "self_attn.q_proj.weight", (nh * hd, H))
    k = w.rand(p + "self_attn.k_proj.weight", (nh * hd, H))
    v = w.rand(p + "self_attn.v_proj.weight", (nh * hd, H))
    o = w.rand(p + "self_attn.o_proj.weight", (H, nh * hd), std=noise * OUT_NOISE)
    o[B, :] = 0.0
    x2 = rms_scale(4.0)  # MASK after layer 1: u + sqrt2 m + o_k
    miss = 0.8 * e_mask - 0.5 * e_ctx - 0.33 * e_bonus
    heads = []
    for k_off in range(1, BLOCK_SIZE):
        m = (k_off + 1) // 2
        for half in range(2):
            heads.append((k_off, m, half))
    assert len(heads) == 30
    decoy = codes.decoy_matrix()
    for h, (k_off, m, half) in enumerate(heads):
        rows = slice(h * hd, (h + 1) * hd)
        from_ctx = k_off % 2 == 1
        if from_ctx:  # last committed token sits at distance k_off + 1
            qpos, kpos = positional_qk(amps2, omegas[:POS_PAIRS], peak=k_off + 1, dim=hd, neox=neox)
            hit = 0.9 * qpos + 0.4 * e_ctx - 0.15 * e_mask - 0.1 * e_bonus
            key_ctx = pos_share * kpos + ctx_share * e_ctx
        else:  # the bonus token sits at distance k_off
            hit = 0.95 * e_bonus - 0.25 * e_ctx - 0.15 * e_mask
            key_ctx = e_ctx
        q[rows, :] = 0.0
        q[rows, U] = miss / x2
        q[rows, O_BASE + k_off] = (hit - miss) / x2
        k[rows, :] = 0.0
        k[rows, C_CTX] = key_ctx / x_ctx
        k[rows, N_TOK] = e_bonus / x_blk
        k[rows, M_MASK] = e_mask / (x_blk * math.sqrt(2.0))
        v[rows, :] = 0.0
        src_gain = x_ctx if from_ctx else x_blk
        v[rows, A.start + half * hd : A.start + (half + 1) * hd] = np.eye(hd) / src_gain
        cols = slice(half * hd, (half + 1) * hd)
        step = codes.matrix(m - 1)[:, cols]
        if k_off == DECOY_OFFSET:  # top-1 decoy, right token second
            step = 0.8 * step + decoy @ step
        o[:, rows] = 0.0
        o[B, rows] = step
    _draft_layer_common(w, p, gain2)

    config = dflash_drafter_config(
        target_cfg, intermediate_size=256, num_hidden_layers=2, num_attention_heads=nh, num_key_value_heads=nh,
        head_dim=hd, max_position_embeddings=MAX_POS, rope_theta=ROPE_THETA, target_layer_ids=TARGET_LAYER_IDS,
    )  # fmt: skip
    return w, config


# The DFlash 2 drafters' extra fields: a 4-tap convolution over 64-channel groups and a
# selector keeping 8 candidates per slot with rank-16 codebooks.
DFLASH2_FIELDS = dict(conv_kernel_size=4, conv_group_size=64, selector_rank=16, selector_top_k=8)


def dflash2_drafter(codes: Codes, target_cfg: dict, rng: np.random.Generator, noise: float):
    """A DFlash 2 drafter: ``dflash_drafter``'s layers (the same weights, from the same
    seed) with the grouped convolution and the candidate selector added.

    The convolution's base kernel is the identity (tap 0 one, the later taps small
    noise) and its per-row projection small noise; the selector's codebooks and hidden
    projection are small noise, so its transition scores are the candidates' logits
    plus a term far below their margins. The selector's walk then follows each slot's
    top candidate, as DFlash's chain does (the decoy at ``DECOY_OFFSET`` included),
    while every DFlash 2 tensor is present, loaded and used: a server that mishandles
    the convolution's block layout or the lattice's indexing changes the drafts, and
    greedy output must stay the target's either way.
    """
    w, config = dflash_drafter(codes, target_cfg, rng, noise)
    extra = Weights(np.random.default_rng([int(rng.integers(1 << 31)), 2]), noise)
    f = DFLASH2_FIELDS
    taps, groups = f["conv_kernel_size"], HIDDEN // f["conv_group_size"]
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = extra.rand(f"layers.{i}.{conv}.base_kernel", (2, taps, HIDDEN), std=noise * OUT_NOISE)
            base[:, 0] += 1.0
            extra.rand(f"layers.{i}.{conv}.kernel_projection.weight", (2 * taps * groups, HIDDEN),
                       std=noise * OUT_NOISE / math.sqrt(HIDDEN))  # fmt: skip
    rank = f["selector_rank"]
    extra.rand("candidate_selector.predecessor_codebook", (VOCAB, rank), std=noise)
    extra.rand("candidate_selector.successor_codebook", (VOCAB, rank), std=noise)
    extra.rand("candidate_selector.hidden_projection.weight", (rank, HIDDEN), std=noise)
    w.update(extra)
    config = dict(config, architectures=["DFlash2DraftModel"])
    config["dflash_config"] = {**config["dflash_config"], **f}
    return w, config


def _draft_layer_common(w: Weights, p: str, gain: float) -> None:
    H, hd = HIDDEN, DRAFT_HD
    w.ones(p + "input_layernorm.weight", H)
    w.ones(p + "post_attention_layernorm.weight", H)
    w.ones(p + "self_attn.q_norm.weight", hd, gain)
    w.ones(p + "self_attn.k_norm.weight", hd, gain)
    w.rand(p + "mlp.gate_proj.weight", (256, H))
    w.rand(p + "mlp.up_proj.weight", (256, H))
    w.rand(p + "mlp.down_proj.weight", (H, 256), std=w.noise * OUT_NOISE)


# ----------------------------------------------------------------------------
# Checkpoint configs: one builder per architecture (the tiny models and the
# realistic shapes differ only in the sizes passed in), then the shapes.


def _target_tail(max_position_embeddings, rope_theta, rope_scaling=None) -> dict:
    """The fields every target config here ends with: SiLU, RMSNorm, no attention bias, an
    untied LM head, bf16, and the BOS/EOS ids of the tokenizer saved beside it."""
    return {
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def deepseek_v2_config(
    *, vocab_size, hidden_size, intermediate_size, moe_intermediate_size, num_hidden_layers,
    num_attention_heads, n_routed_experts, n_shared_experts, num_experts_per_tok, first_k_dense_replace,
    max_position_embeddings, rope_theta, rope_scaling,
) -> dict:  # fmt: skip
    """A DeepSeek-V2 (MLA, MoE) config: MHA-sized KV heads, no query LoRA, greedy routing."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "moe_intermediate_size": moe_intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_attention_heads,
        "q_lora_rank": None,
        **MLA,
        "n_routed_experts": n_routed_experts,
        "n_shared_experts": n_shared_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "first_k_dense_replace": first_k_dense_replace,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        **_target_tail(max_position_embeddings, rope_theta, rope_scaling),
    }


def qwen3_config(
    *, vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, max_position_embeddings, rope_theta,
) -> dict:  # fmt: skip
    """A dense Qwen3 (GQA) config."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        **_target_tail(max_position_embeddings, rope_theta),
    }


def hybrid_layer_types(num_layers: int, full_attention_interval: int) -> list[str]:
    """Qwen3-Next's layer kinds: every ``full_attention_interval``-th layer is full attention."""
    return [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention" for i in range(num_layers)
    ]


def qwen3_next_config(
    *, vocab_size, hidden_size, intermediate_size, num_hidden_layers, full_attention_interval,
    num_attention_heads, num_key_value_heads, head_dim, linear_conv_kernel_dim, linear_key_head_dim,
    linear_value_head_dim, linear_num_key_heads, linear_num_value_heads, num_experts, num_experts_per_tok,
    moe_intermediate_size, shared_expert_intermediate_size, max_position_embeddings, rope_theta,
) -> dict:  # fmt: skip
    """A Qwen3-Next config: Gated DeltaNet layers with gated full attention every
    ``full_attention_interval`` layers, a MoE with a shared expert in every layer."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "layer_types": hybrid_layer_types(num_hidden_layers, full_attention_interval),
        "full_attention_interval": full_attention_interval,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "partial_rotary_factor": 0.25,
        "linear_conv_kernel_dim": linear_conv_kernel_dim,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_value_head_dim": linear_value_head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "moe_intermediate_size": moe_intermediate_size,
        "shared_expert_intermediate_size": shared_expert_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        **_target_tail(max_position_embeddings, rope_theta),
    }


def dflash_drafter_config(
    target: dict, *, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim, max_position_embeddings, rope_theta, target_layer_ids,
) -> dict:  # fmt: skip
    """A DFlash drafter (Qwen3 layers, ``BLOCK_SIZE``-token blocks) of ``target``'s vocabulary
    and width, reading the features of ``target_layer_ids``: a Qwen3 config without the
    special-token ids, which come from the target."""
    cfg = qwen3_config(
        vocab_size=target["vocab_size"], hidden_size=target["hidden_size"], intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
    )  # fmt: skip
    cfg["architectures"] = ["DFlashDraftModel"]
    del cfg["bos_token_id"], cfg["eos_token_id"]
    cfg["block_size"] = BLOCK_SIZE
    cfg["dflash_config"] = {
        "target_layer_ids": target_layer_ids,
        "mask_token": "<|MASK|>",
        "mask_token_id": MASK_ID,
        "num_target_layers": target["num_hidden_layers"],
    }
    return cfg


# The public DFlash drafters of MoE targets: five layers of 16 query and 4 KV heads of 128.
MOE_DRAFTER_LAYERS = dict(
    intermediate_size=6144, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=4, head_dim=128
)  # fmt: skip


def same_shape_drafter_config(target: dict, target_layer_ids: list[int], rope_theta=None) -> dict:
    """A 5-layer DFlash drafter in the target's own attention and MLP shape, as the public
    dense-target drafters are."""
    return dflash_drafter_config(
        target,
        intermediate_size=target["intermediate_size"],
        num_hidden_layers=5,
        num_attention_heads=target["num_attention_heads"],
        num_key_value_heads=target["num_key_value_heads"],
        head_dim=target["head_dim"],
        max_position_embeddings=target["max_position_embeddings"],
        rope_theta=target["rope_theta"] if rope_theta is None else rope_theta,
        target_layer_ids=target_layer_ids,
    )


def v2lite_config() -> dict:
    return deepseek_v2_config(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, n_routed_experts=64, n_shared_experts=2,
        num_experts_per_tok=6, first_k_dense_replace=1, max_position_embeddings=163840, rope_theta=10000,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    )  # fmt: skip


def v2lite_drafter_config(target: dict) -> dict:
    return dflash_drafter_config(
        target, **MOE_DRAFTER_LAYERS, max_position_embeddings=163840, rope_theta=10000,
        target_layer_ids=[1, 7, 13, 19, 25],
    )  # fmt: skip


def qwen3_8b_config() -> dict:
    """Qwen3-8B's published shape (GQA: 36 layers, 32 query and 8 KV heads of 128)."""
    return qwen3_config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000,
    )  # fmt: skip


def qwen36_a3b_config() -> dict:
    """Qwen3.6-35B-A3B's text stack (10 x [3 Gated DeltaNet + 1 gated attention],
    MoE everywhere) on the Qwen3-Next architecture, which has the same blocks and
    which upstream serves text-only with DFlash hooks."""
    return qwen3_next_config(
        vocab_size=248320, hidden_size=2048, intermediate_size=5120, num_hidden_layers=40,
        full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, max_position_embeddings=262144, rope_theta=10000000,
    )  # fmt: skip


def qwen3_8b_drafter_config(target: dict) -> dict:
    """Features from five spread layers of the 36-layer target."""
    return same_shape_drafter_config(target, [1, 9, 17, 25, 33])


def hybrid_drafter_config(target: dict) -> dict:
    """A DFlash drafter of the public drafters' shape for that target: five
    layers at the target's hidden size, features from five spread target layers."""
    layers = target["num_hidden_layers"]
    return dflash_drafter_config(
        target, **MOE_DRAFTER_LAYERS, max_position_embeddings=target["max_position_embeddings"],
        rope_theta=target["rope_theta"], target_layer_ids=[1 + i * (layers - 3) // 4 for i in range(5)],
    )  # fmt: skip


def gptoss_20b_config() -> dict:
    """gpt-oss-20b's published shape (24 layers alternating 128-token sliding windows
    and full attention, 64 query and 8 KV heads of 64, sinks, 32 experts), as bf16."""
    layers = 24
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": layers,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "sliding_window": 128,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "swiglu_limit": 7.0,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False,
        },  # fmt: skip
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def gptoss_20b_drafter_config(target: dict) -> dict:
    """A 5-layer DFlash drafter in the target's attention shape (64 query and 8 KV
    heads of 64), features from five spread target layers."""
    return same_shape_drafter_config(target, [1, 6, 11, 16, 21], rope_theta=target["rope_parameters"]["rope_theta"])


# ----------------------------------------------------------------------------
# Writing


def save_model(out: Path, weights: dict | None, config: dict) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if weights is not None:
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16) for k, v in weights.items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


# (--only kind, name, target builder); the drafter is always ``dflash_drafter``.
TINY_PAIRS = (
    ("mla", "tiny-mla", mla_target),
    ("qwen3", "tiny-qwen3", qwen3_target),
    ("hybrid", "tiny-qwen3next", qwen3next_target),
    ("gptoss", "tiny-gptoss", gptoss_target),
)
# Tiny pairs that also get a DFlash 2 drafter (``<name>-dflash2``).
DFLASH2_PAIRS = ("tiny-mla", "tiny-qwen3")
#: A DFlash 2 drafter with a feature the server does not implement (drafter attention sinks).
UNSUPPORTED_DFLASH2 = "tiny-qwen3-dflash2-unsupported"
# (--only kind, name, target config, drafter config from the target's), served with --load-format dummy.
SHAPE_PAIRS = (
    ("shapes", "v2lite-shape", v2lite_config, v2lite_drafter_config),
    ("shapes", "qwen3-8b-shape", qwen3_8b_config, qwen3_8b_drafter_config),
    ("hybrid-shapes", "qwen36-a3b-shape", qwen36_a3b_config, hybrid_drafter_config),
    ("swa-shapes", "gptoss-20b-shape", gptoss_20b_config, gptoss_20b_drafter_config),
)
KINDS = ("mla", "qwen3", "hybrid", "shapes", "hybrid-shapes", "gptoss", "swa-shapes")


def generate(
    outdir: Path,
    seed: int = 0,
    noise: float = 0.02,
    which=KINDS,
) -> dict:
    rng = np.random.default_rng(seed)
    vocab_words = words(rng)
    codes = Codes(rng)
    outdir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "seed": seed,
        "noise": noise,
        "vocab_size": VOCAB,
        "mask_token_id": MASK_ID,
        "block_size": BLOCK_SIZE,
        "decoy_offset": DECOY_OFFSET,
        "tau": [codes.tau(t) for t in range(VOCAB)],
        "words": vocab_words,
        "models": {},
    }

    def save_pair(name, target_weights, target_cfg, drafter_weights, drafter_cfg, **facts):
        save_model(outdir / name, target_weights, target_cfg)
        save_tokenizer(outdir / name, vocab_words)
        save_model(outdir / f"{name}-dflash", drafter_weights, drafter_cfg)
        manifest["models"][name] = {"target": name, "drafter": f"{name}-dflash", **facts}

    for kind, name, build_target in TINY_PAIRS:
        if kind in which:
            tw, tcfg = build_target(codes, np.random.default_rng([seed, len(name)]), noise)
            dw, dcfg = dflash_drafter(codes, tcfg, np.random.default_rng([seed, 99, len(name)]), noise)
            save_pair(name, tw, tcfg, dw, dcfg)
            if name in DFLASH2_PAIRS:
                d2w, d2cfg = dflash2_drafter(codes, tcfg, np.random.default_rng([seed, 99, len(name)]), noise)
                save_model(outdir / f"{name}-dflash2", d2w, d2cfg)
                manifest["models"][name]["dflash2_drafter"] = f"{name}-dflash2"
                if name == "tiny-qwen3":
                    bad = dict(d2cfg, dflash_config={**d2cfg["dflash_config"], "attention_sink_bias": True})
                    save_model(outdir / UNSUPPORTED_DFLASH2, d2w, bad)
                    manifest["models"][name]["unsupported_dflash2_drafter"] = UNSUPPORTED_DFLASH2
    for kind, name, target_config, drafter_config in SHAPE_PAIRS:
        if kind in which:
            tcfg = target_config()
            save_pair(name, None, tcfg, None, drafter_config(tcfg), load_format="dummy")
    path = outdir / "manifest.json"
    if path.exists():  # a partial run (--only) into a full set keeps the set's other pairs listed
        old = json.loads(path.read_text())
        if all(old.get(k) == manifest[k] for k in ("seed", "noise", "tau")):
            manifest["models"] = {**old.get("models", {}), **manifest["models"]}
    path.write_text(json.dumps(manifest) + "\n")
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.02, help="std of the non-structural weights")
    ap.add_argument("--only", nargs="+", choices=KINDS, default=list(KINDS))
    args = ap.parse_args(argv)
    generate(args.outdir, seed=args.seed, noise=args.noise, which=tuple(args.only))
    print(f"wrote {', '.join(sorted(os.listdir(args.outdir)))} under {args.outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
