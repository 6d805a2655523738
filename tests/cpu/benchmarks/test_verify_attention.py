# SPDX-License-Identifier: Apache-2.0
"""benchmarks/verify_attention.py on the CPU (Triton interpreter): the inputs,
the arithmetic of the roofline, and that every strategy row of the matrix is
produced and checked against the fp32 reference, for the MLA and GQA layouts.
The timer is the one GPU-only piece; it is replaced by a constant here, and no
assertion reads a time."""

import pytest
import torch

from benchmarks import verify_attention as va


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(va, "DEVICE", "cpu")
    monkeypatch.setattr(va, "bench", lambda fn, slow=False, graph=True: 1.0)


def test_mla_arithmetic_and_matrix_are_unchanged():
    h, n, p, bs = 16, 65, 16384, 1
    flops, nbytes = va.flops_bytes(h, n, p, bs)
    assert flops == 2 * bs * n * h * (p + n) * (576 + 512)
    assert nbytes == 2 * (bs * (p + n) * 576 + bs * n * h * (576 + 512))  # V inside the latent K
    assert len(va.full_matrix()) == 50 and (16, 4, 65536, 8) in va.full_matrix()


def test_gqa_arithmetic_reads_k_and_v():
    flops, nbytes = va.flops_bytes(32, 17, 4096, 8, va.GQA)
    assert flops == 2 * 8 * 17 * 32 * (4096 + 17) * 256
    assert nbytes == 2 * (8 * (4096 + 17) * 8 * 256 + 8 * 17 * 32 * 256)
    shapes = va.full_matrix(va.GQA)
    assert len(shapes) == 24 and {s[0] for s in shapes} == {32}


@pytest.mark.parametrize("heads,h", [(va.GQA, 16), (va.MLA, 2)])
def test_matrix_rows_on_the_interpreter(on_cpu, heads, h):
    q, k, v, indptr, *_ = va.make_inputs(h, 5, 40, 2, dtype=torch.float32, heads=heads)
    assert k.shape[1:] == (heads.hkv, heads.dqk) and v.shape[1:] == (heads.hkv, heads.dv)
    assert (v.data_ptr() == k.data_ptr()) == heads.shared_kv
    # fp16: the Triton interpreter mishandles bf16 tiles (the GPU runs bf16).
    rows = va.run_matrix([(h, 5, 40, 2)], ["reference", "fused", "fused_sm120", "flashinfer_dense"],
                         (100.0, 1000.0), (9, 0), verbose=False, heads=heads, dtype=torch.float16)  # fmt: skip
    by = {r["strategy"]: r for r in rows}
    assert set(by) == {"reference", "fused", "fused_sm120", "flashinfer_dense"}
    flops, nbytes = va.flops_bytes(h, 5, 40, 2, heads)
    for name in ("reference", "fused", "fused_sm120"):
        assert by[name]["max_err"] < 5e-3, by[name]  # fp16 inputs against the fp32 reference
        assert by[name]["gbps"] == round(nbytes / 1.0 / 1e6, 1)  # the constant 1 ms timer
    assert by["fused"]["config"] == va.select_config((9, 0), heads.dqk, heads.dv, heads.shared_kv).__dict__
    # FlashInfer's dense-mask path: not for MLA; on a CPU it cannot run, and says so in the row.
    assert "ms" not in by["flashinfer_dense"]
    assert ("unavailable" in by["flashinfer_dense"]) or ("error" in by["flashinfer_dense"])
    if heads.shared_kv:
        assert "no custom mask" in by["flashinfer_dense"]["unavailable"]


def test_results_rebuilt_from_the_runs_stdout(on_cpu, capsys, tmp_path):
    """--from-log: the rows printed during a run become the same JSON and a plot."""
    import json

    meta = {"peak_bf16_tflops": 100.0, "hbm_copy_gbps": 1000.0, "attn": {"name": "gqa"}}
    print(json.dumps(meta))
    rows = va.run_matrix([(16, 5, 40, 2)], ["reference", "fused"], (100.0, 1000.0), (9, 0),
                         heads=va.GQA, dtype=torch.float16)  # fmt: skip
    log = capsys.readouterr().out.splitlines()
    log.append('{"H": 16, "N": 5, "P": 4')  # the last line of a run cut by its timeout
    got_meta, got_rows = va.rows_from_log(log)
    assert got_meta == meta and got_rows == json.loads(json.dumps(rows))
    va.write_results(got_meta, got_rows, str(tmp_path), "t", va.GQA)
    saved = json.loads((tmp_path / "verify_attention_gqa_t.json").read_text())
    assert saved["rows"] == got_rows and (tmp_path / "verify_attention_gqa_t.png").stat().st_size > 0
    with pytest.raises(ValueError, match="one metadata line"):
        va.rows_from_log(log[1:])


def test_tune_match_keeps_the_default_first():
    every = va.tune_configs()
    assert every == va.TUNE_CONFIGS
    picked = va.tune_configs("dv_split=2")
    assert picked[0] == va.TUNE_CONFIGS[0]
    assert picked[1:] and all(c.dv_split == 2 for c in picked[1:])
    assert va.tune_configs("no such field") == [va.TUNE_CONFIGS[0]]


def test_sm12x_sweep_set_and_previous_tile(on_cpu):
    configs = va.tune_configs("", "sm12x")
    assert configs[0] == va.select_config((12, 0), va.DQK, va.DV) and va.SM12X_PREV in configs
    assert va.config_name(configs[0].__dict__) == "64x16w8s1qbc4rp"
    rows = va.run_matrix([(2, 5, 40, 1)], ["reference", "fused_sm120", "fused_sm120_prev"],
                         (100.0, 1000.0), (9, 0), verbose=False, dtype=torch.float16)  # fmt: skip
    by = {r["strategy"]: r for r in rows}
    assert by["fused_sm120_prev"]["config"] == va.SM12X_PREV.__dict__
    assert by["fused_sm120"]["max_err"] < 5e-3 and by["fused_sm120_prev"]["max_err"] < 5e-3


@pytest.mark.parametrize("family", [va.GPTOSS_SWA, va.GEMMA4_FULL], ids=lambda h: h.name)
def test_window_and_sink_rows_on_the_interpreter(on_cpu, family):
    """The sliding-window families at a tiny size with a window that cuts (3
    positions): the fused kernels match the reference; upstream's dense-mask
    fallback, given the window as its backend gives it, does not on a tree
    (it places tree nodes by index), and does without a window."""
    heads = va.dataclasses.replace(family, window=3 if family.window else None)
    h = 16
    rows = va.run_matrix([(h, 5, 40, 2)], ["reference", "fused", "fused_sm120", "upstream_extend"],
                         (100.0, 1000.0), (9, 0), verbose=False, heads=heads, dtype=torch.float16)  # fmt: skip
    by = {r["strategy"]: r for r in rows}
    for name in ("reference", "fused", "fused_sm120"):
        assert by[name]["max_err"] < 5e-3, by[name]
    if heads.window is None:
        assert by["upstream_extend"]["max_err"] < 5e-3
    else:
        assert by["upstream_extend"]["max_err"] > 0.1
    flops, _ = va.flops_bytes(h, 5, 40, 2, heads)
    assert flops == 2 * 2 * 5 * h * (min(40, heads.window or 40) + 5) * 2 * heads.dqk
