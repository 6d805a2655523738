# SPDX-License-Identifier: Apache-2.0
"""benchmarks/e2e_step.py's ``--target`` shapes: the model pairs scripts/make_test_models.py
writes for them, the server flags of every target as the real pinned ServerArgs resolves them
(device "cuda" on this CPU host: no GPU is touched while arguments resolve), and the
refusals the benchmark makes before a server starts, each one the server's own."""

import argparse
import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import e2e_step as es

REPO = Path(__file__).resolve().parents[3]


def _generator():
    spec = importlib.util.spec_from_file_location("make_test_models", REPO / "scripts" / "make_test_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An empty models dir: shape_models fills it one ``--only`` kind at a time."""
    return tmp_path_factory.mktemp("e2e_step_models")


def test_targets_are_the_generators_shape_pairs():
    pairs = {name: kind for kind, name, _, _ in _generator().SHAPE_PAIRS}
    for target in es.GENERATED_TARGETS:
        name, drafter = es.TARGETS[target]["dirs"]
        assert pairs[name] == es.TARGETS[target]["kind"] and drafter == f"{name}-dflash", target


def test_qwen3_8b_pair_keeps_the_shape_the_benchmark_wrote():
    """The generator's Qwen3-8B pair replaced the one the benchmark wrote itself: the same
    published shape and drafter; only the special-token ids follow the tokenizer it ships."""
    gen = _generator()
    target = gen.qwen3_8b_config()
    assert {k: target[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "vocab_size", "rope_theta",
                                   "max_position_embeddings")} == {
        "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000,
        "max_position_embeddings": 40960}  # fmt: skip
    drafter = gen.qwen3_8b_drafter_config(target)
    assert drafter["num_hidden_layers"] == 5 and drafter["block_size"] == 16
    assert drafter["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]


def test_a_given_pair_that_is_missing_is_named_not_generated(tmp_path):
    """The learned pair is not generated: a --models dir without it stops with what to give."""
    assert "learned" not in es.GENERATED_TARGETS
    with pytest.raises(SystemExit, match="unpacked pair"):
        es.shape_models(tmp_path, "learned")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", es.GENERATED_TARGETS)
def test_target_dirs_are_generated_when_missing(models, target):
    """Each target's pair, written by the generator's own ``--only`` kind into a dir that
    lacks it: transformers reads the target with the listed architecture, the pinned
    upstream's DFlash parser reads the drafter."""
    from transformers import AutoConfig, PretrainedConfig

    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    info = es.TARGETS[target]
    target_dir, drafter_dir = es.shape_models(models, target)
    assert (target_dir.name, drafter_dir.name) == info["dirs"]
    tcfg = json.loads((target_dir / "config.json").read_text())
    assert tcfg["architectures"] == [info["architecture"]]
    assert AutoConfig.from_pretrained(str(target_dir)).architectures == [info["architecture"]]
    assert (target_dir / "tokenizer.json").exists()
    layer_types = set(tcfg.get("layer_types", ()))
    assert ("linear_attention" in layer_types) == bool(info.get("linear_attention"))
    assert ("sliding_attention" in layer_types) == bool(info.get("sliding_window"))
    parsed = parse_dflash_draft_config(
        draft_hf_config=PretrainedConfig.from_dict(json.loads((drafter_dir / "config.json").read_text())))
    assert parsed.block_size == 16 and max(parsed.target_layer_ids) < tcfg["num_hidden_layers"]
    stamp = (target_dir / "config.json").stat().st_mtime_ns
    es.shape_models(models, target)  # present: not written again
    assert (target_dir / "config.json").stat().st_mtime_ns == stamp


def resolve(models, target, text, batches=(1, 8), max_ctx=16384):
    """The benchmark's flags for one server, resolved by the pinned ServerArgs with the
    server's environment; raises what the server would refuse at startup."""
    from sglang.srt.server_args import ServerArgs

    spec = es.parse_spec(text)
    target_dir, drafter_dir = es.shape_models(models, target)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", str(target_dir), "--device", "cuda",
                            *es.server_args(spec, str(drafter_dir), max_ctx, list(batches), target)])
    env = es.server_env(spec, models / "triton-cache")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return ServerArgs.from_cli_args(ns)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# The rows of the hybrid and sliding-window targets: no speculation, DFLASH, DDTREE B=16 and B=64.
ROW_CONFIGS = ["nospec", "dflash", "ddtree16", "ddtree64"]


@pytest.mark.parametrize("text", ROW_CONFIGS)
def test_hybrid_target_server_args(models, text):
    """One recurrent-state slot per running request, so the per-node verify scratch is
    sized by the batch the benchmark runs, not by the free memory."""
    es.check_target("qwen36-a3b", [es.parse_spec(text)])
    sa = resolve(models, "qwen36-a3b", text)
    assert sa.max_mamba_cache_size == sa.max_running_requests == 8
    assert sa.attention_backend == "triton" and sa.load_format == "dummy"
    if text.startswith("ddtree"):
        assert sa.speculative_num_draft_tokens == es.ddtree_budget(text) + 1


def test_hybrid_target_fits_an_80gb_gpu(models):
    """The hybrid shape's 65 GiB of weights take more than 0.8 of an 80 GB card (its servers
    refused to start there): the static pool grows to hold them and batch 1's KV and states,
    and one recurrent-state slot is kept for batch 1; other targets and larger GPUs keep 0.8."""
    h100, h200 = 79.19, 139.8
    args = es.server_args(es.parse_spec("ddtree16"), "d", 16384, [1], "qwen36-a3b", h100)
    fraction = float(args[args.index("--mem-fraction-static") + 1])
    assert fraction * h100 - 65.3 >= 7.0 and (1 - fraction) * h100 >= 5.0  # pool room, graph room
    assert args[args.index("--max-mamba-cache-size") + 1] == args[args.index("--max-running-requests") + 1] == "1"
    assert es.mem_fraction_static("qwen36-a3b", h200) == es.MEM_FRACTION_STATIC
    assert es.mem_fraction_static("qwen36-a3b", None) == es.MEM_FRACTION_STATIC
    for target in ("v2lite", "qwen3-8b", "gptoss-20b"):
        assert es.mem_fraction_static(target, h100) == es.MEM_FRACTION_STATIC
    sa = resolve(models, "qwen36-a3b", "ddtree16", batches=(1,))
    assert sa.mem_fraction_static == es.MEM_FRACTION_STATIC  # no GPU size given: the default
    assert sa.max_mamba_cache_size == sa.max_running_requests == 1


@pytest.mark.parametrize("text", ROW_CONFIGS)
def test_sliding_window_target_server_args(models, text):
    """gpt-oss on Triton; its experts run where upstream puts them for bf16 weights."""
    es.check_target("gptoss-20b", [es.parse_spec(text)])
    sa = resolve(models, "gptoss-20b", text)
    assert sa.attention_backend == "triton"
    assert sa.max_mamba_cache_size is None


def test_sliding_window_target_experts_ignore_the_uniform_routing_switch(models):
    """Upstream routes gpt-oss's experts with triton_kernels, which never reads
    SGLANG_SIMULATE_UNIFORM_EXPERTS (only select_experts does), so a uniform-routing run
    would be mislabelled: refused."""
    import inspect

    from sglang.srt.layers.moe import topk

    sa = resolve(models, "gptoss-20b", "dflash")
    assert sa.moe_runner_backend == "triton_kernel"
    assert "SGLANG_SIMULATE_UNIFORM_EXPERTS" in inspect.getsource(topk.select_experts)
    assert "SGLANG_SIMULATE_UNIFORM_EXPERTS" not in inspect.getsource(topk.routing)
    with pytest.raises(ValueError, match="triton_kernel.*--expert-routing model"):
        es.check_target("gptoss-20b", [es.parse_spec("dflash")], "uniform")
    es.check_target("qwen36-a3b", [es.parse_spec("dflash")], "uniform")  # its experts go through select_experts


@pytest.mark.parametrize("text,msg", [
    ("dflash:flashinfer", "triton backend only"),
    ("ddtree16:flashinfer", "triton backend only"),
    ("nospec:flashinfer", "triton backend only"),
    ("ddtree16@upstream_extend", "refuses the upstream verify path"),
])  # fmt: skip
def test_sliding_window_refusals_are_the_servers(models, text, msg):
    """What the benchmark refuses on gpt-oss, upstream's or DDTREE's server argument
    handling refuses too, minutes into a start that the benchmark saves."""
    with pytest.raises(ValueError, match=msg):
        es.check_target("gptoss-20b", [es.parse_spec(text)])
    with pytest.raises((ValueError, AssertionError)):
        resolve(models, "gptoss-20b", text)


def test_hybrid_budget_limit_is_the_servers():
    """DDTREE budgets above 64 on the hybrid target: the model runner refuses them at
    startup (after the weights load), so the benchmark refuses them first."""
    from sglang.srt.speculative.ddtree import linear_state

    es.check_target("qwen36-a3b", [es.parse_spec(f"ddtree{linear_state.MAX_HYBRID_BUDGET}")])
    with pytest.raises(ValueError, match=f"up to {linear_state.MAX_HYBRID_BUDGET}"):
        es.check_target("qwen36-a3b", [es.parse_spec("dflash"), es.parse_spec("ddtree65")])
    runner = SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(
        architectures=[es.TARGETS["qwen36-a3b"]["architecture"]])))
    with pytest.raises(ValueError, match="--speculative-ddtree-budget up to"):
        linear_state.check_tree_verify_support(runner, verify_width=66)
    es.check_target("v2lite", [es.parse_spec("ddtree128")])  # no such limit off the hybrid


def test_main_refuses_before_any_server(tmp_path, capsys):
    """The refusal reaches the command line as a usage error; nothing was started."""
    with pytest.raises(SystemExit):
        es.main(["--target", "qwen36-a3b", "--configs", "dflash,ddtree128", "--out-dir", str(tmp_path),
                 "--models", str(tmp_path / "models")])
    assert "up to 64" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()


def test_linear_verify_share_reaches_the_table():
    """A hybrid target's profile gives the linear layers' tree verify its own column."""
    def prof(config, verify, cats, total):
        return {"config": config, "verify": verify, "backend": "triton", "ctx": 16384, "batch": 1,
                "categories": {k: {"ms_per_step": v} for k, v in cats.items()}, "gpu_ms_per_step": total}

    profiles = [prof("dflash", "fused", {"tree_verify": 1.0, "linear_verify": 2.0, "linear_other": 1.0}, 20.0),
                prof("ddtree16", "fused", {"tree_verify": 1.5, "linear_verify": 5.0, "linear_other": 1.0}, 25.0),
                prof("nospec", "-", {"linear_verify": 0.5, "linear_other": 1.0}, 10.0)]
    shares = {s["config"]: s for s in es.verify_shares(profiles)}
    assert set(shares) == {"dflash", "ddtree16"}  # no verify without speculation
    assert shares["ddtree16"]["linear_verify_ms"] == 5.0
    assert shares["ddtree16"]["linear_share"] == pytest.approx(0.2)
    assert shares["ddtree16"]["share"] == pytest.approx(0.06)
    rows = [{"config": c, "verify": v, "backend": "triton", "ctx": 16384, "batch": 1, "ms_per_step": ms,
             "accept_length": 1.0} for c, v, ms in (("nospec", "-", 8.0), ("dflash", "fused", 10.0),
                                                     ("ddtree16", "fused", 12.0))]
    md = es.markdown(rows, list(shares.values())).splitlines()
    assert md[0].endswith("| verify attn share | linear verify share |")
    assert md[2].endswith("| - | - |")
    assert md[3].endswith("| 5 % | 10 % |")
    assert md[4] == "| ddtree16 | fused | triton | 16384 | 1 | 12.00 | 1.20 | 1.00 | 6 % | 20 % |"
    # a target without linear layers keeps the table it had
    plain = [dict(p, categories={"tree_verify": {"ms_per_step": 1.0}}) for p in profiles[:2]]
    assert "linear" not in es.markdown(rows, es.verify_shares(plain))


def test_the_step_goal_and_no_v2lite_reference_on_the_new_targets():
    """DDTREE B=16 within 1.3x of DFLASH on the hybrid and sliding-window targets; the
    reference run (upstream on the DeepSeek-V2-Lite shape) is compared with V2-Lite runs only."""
    rows = [{"config": c, "verify": "fused", "backend": "triton", "ctx": 16384, "batch": 1, "ms_per_step": ms,
             "accept_length": 1.0} for c, ms in (("dflash", 10.0), ("ddtree16", 12.0), ("ddtree64", 20.0))]
    reference = [{"config": "DFLASH chain (16 tokens verified), --attention-backend flashinfer", "ctx": 16384,
                  "batch": 1, "ms_per_step": 9.0}]
    for target in ("qwen36-a3b", "gptoss-20b"):
        got = {q["ratio"]: q for q in es.finish({"target": target, "rows": rows}, reference)["ratios"]}
        assert got["DDTREE B=16 fused / DFLASH fused"]["target"] == 1.3
        assert got["DDTREE B=16 fused / DFLASH fused"]["value"] == pytest.approx(1.2)
        assert "target" not in got["DDTREE B=64 fused / DFLASH fused"]
        assert all(q["source"] == "this run" for q in got.values())
    v2 = {q["ratio"]: q for q in es.finish({"target": "v2lite", "rows": rows}, reference)["ratios"]}
    assert v2["DDTREE B=64 fused / DFLASH fused"]["target"] == 1.25 and "target" not in v2["DDTREE B=16 fused / DFLASH fused"]
    assert any(q["source"] != "this run" for q in v2.values())


def test_the_learned_pair_runs_within_its_context(tmp_path, capsys):
    """Its servers get the pair's 4,096 tokens, not the margin the generated shapes get, and a
    point that could decode past them is refused before any server starts."""
    assert es.context_length("learned", 512) == 4096
    assert es.context_length("v2lite", 16384) == 16384 + es.CONTEXT_MARGIN
    args = es.server_args(es.parse_spec("ddtree16"), "d", 512, [1, 8], "learned")
    assert args[args.index("--context-length") + 1] == "4096"
    with pytest.raises(SystemExit):
        es.main(["--target", "learned", "--models", str(tmp_path), "--ctx", "2048", "--configs", "nospec",
                 "--out-dir", str(tmp_path)])
    assert "learned holds 4096 tokens" in capsys.readouterr().err
