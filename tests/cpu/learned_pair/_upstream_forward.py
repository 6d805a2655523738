# SPDX-License-Identifier: Apache-2.0
"""Run a learned pair through upstream SGLang's own model classes on the CPU and print how
far they are from the torch models that trained it (JSON on the last line of stdout).

Runs in its own process (``python -m tests.cpu.learned_pair._upstream_forward PAIR``): it
initialises a one-rank gloo process group and SGLang's parallel state, which must not leak
into the test session. Real upstream code: ``ServerArgs`` for DFLASH and DDTREE with this
pair, ``Qwen3ForCausalLM`` and ``DFlashDraftModel`` built from the checkpoint configs and
filled by their own ``load_weights``, the target's aux hidden capture
(``set_dflash_layers_to_capture``), the drafter's context projection and K/V
materialisation exactly as ``DFlashWorkerV2._append_target_hidden_sequential`` does it.
Stand-ins: the attention backend (plain softmax attention over the K/V the layers hand
it, causal for the target, non-causal over context + block for the drafter: what the
server's kernels compute) and RoPE's platform switch (upstream picks a vLLM kernel on a
machine that is neither CUDA nor its CPU engine; here the native torch path runs).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch


class DenseAttention:
    """Softmax attention over [this layer's context K/V, if any] + the K/V of the forward."""

    def __init__(self, causal: bool, ctx: dict | None = None):
        self.causal, self.ctx = causal, ctx or {}

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        nh, nkv, hd = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        q, k, v = q.view(-1, nh, hd), k.view(-1, nkv, hd), v.view(-1, nkv, layer.v_head_dim)
        if layer.layer_id in self.ctx:
            ck, cv = self.ctx[layer.layer_id]
            k, v = torch.cat([ck, k]), torch.cat([cv, v])
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * layer.scaling
        if self.causal:
            t, n = q.shape[0], k.shape[0]
            s = s.masked_fill(~torch.ones(t, n, dtype=torch.bool).tril(n - t), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float()).reshape(q.shape[0], -1).to(q.dtype)


def main(pair: Path) -> dict:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from scripts.learned_pair import checkpoint, dflash_batch
    from scripts.learned_pair.tokenizer import MASK_ID
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.layers.rotary_embedding import base as rope_base
    from sglang.srt.model_executor.forward_context import ForwardContext, set_forward_context
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.models.qwen3 import Qwen3ForCausalLM
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    result = {}

    def server_args(algorithm, **kw):
        return ServerArgs(model_path=str(pair / "target"), speculative_algorithm=algorithm,
                          speculative_draft_model_path=str(pair / "drafter"), device="cuda",
                          skip_tokenizer_init=True, attention_backend="triton", **kw)

    sa = server_args("DFLASH")
    result["dflash_block"] = sa.speculative_num_draft_tokens
    result["ddtree_verify_width"] = {b: server_args("DDTREE", speculative_ddtree_budget=b).speculative_num_draft_tokens
                                     for b in (4, 16, 128)}
    publish(sa, role="test")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(tensor_model_parallel_size=1)
    initialize_dp_attention(sa, ModelConfig.from_server_args(sa))

    with mock.patch.object(rope_base, "_is_cpu", True):
        up_target = Qwen3ForCausalLM(AutoConfig.from_pretrained(str(pair / "target")))
        up_drafter = DFlashDraftModel(AutoConfig.from_pretrained(str(pair / "drafter")))
    up_target.load_weights(load_file(str(pair / "target" / "model.safetensors")).items())
    up_drafter.load_weights(load_file(str(pair / "drafter" / "model.safetensors")).items())
    result["tied_head"] = up_target.lm_head.weight.data_ptr() == up_target.model.embed_tokens.weight.data_ptr()
    layer_ids = json.loads((pair / "drafter" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    up_target.set_dflash_layers_to_capture(layer_ids)

    target, drafter = checkpoint.load_pair(pair)
    prompt = json.loads((pair / "prompts.jsonl").read_text().splitlines()[0])["prompt_ids"]
    ids = torch.tensor(prompt[:48])
    s = ids.numel()
    pos = torch.arange(s)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True))
    with torch.no_grad():
        set_forward_context(ForwardContext(attn_backend=DenseAttention(causal=True)))
        hidden, aux = up_target.model(ids, pos, batch)
        aux = torch.cat(aux, dim=-1) if isinstance(aux, (list, tuple)) else aux
        mine, captured = target(ids[None], capture=tuple(layer_ids), logits=False)
        result["target_hidden_max_abs_diff"] = float((hidden - mine[0]).abs().max())
        result["target_logits_max_abs_diff"] = float(
            (torch.nn.functional.linear(hidden, up_target.lm_head.weight) - torch.nn.functional.linear(
                mine[0], target.lm_head_weight)).abs().max())
        result["aux_hidden_max_abs_diff"] = float((aux - torch.cat([captured[i] for i in layer_ids], -1)[0]).abs().max())
        result["hidden_scale"] = float(mine.abs().max())

        diffs = []
        for a in (8, 21, s - 16):
            blocks = dflash_batch.make_blocks(ids[None], torch.tensor([[a]]), drafter.shape.block_size, MASK_ID, 7.0)
            embeds = target.model.embed_tokens(blocks.ids)
            ours = drafter(embeds, blocks.pos, drafter.context(captured), pos, blocks.mask)[0]
            ctx_hidden = up_drafter.project_target_hidden(aux[:a])
            ctx_kv = {}
            for layer in up_drafter.layers:
                attn = layer.self_attn
                k, v = attn.kv_proj_only(up_drafter.prepare_context_hidden_for_kv(layer, ctx_hidden))
                k = attn.apply_k_rope(pos[:a], attn.apply_k_norm(k))
                ctx_kv[attn.attn.layer_id] = (k.view(-1, attn.num_kv_heads, attn.head_dim),
                                              v.view(-1, attn.num_kv_heads, attn.head_dim))
            set_forward_context(ForwardContext(attn_backend=DenseAttention(causal=False, ctx=ctx_kv)))
            theirs = up_drafter(None, blocks.pos[0], batch, input_embeds=embeds[0]).hidden_states
            diffs.append(float((theirs - ours).abs().max()))
        result["drafter_hidden_max_abs_diff"] = max(diffs)
        result["drafter_hidden_scale"] = float(ours.abs().max())
    return result


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
