# SPDX-License-Identifier: Apache-2.0
"""Every registered attention backend x capability x MLA/MHA x speculative on/off.

Each cell runs the real (patched) upstream ServerArgs resolution with only the
GPU's reported capability faked, and the same cell on pristine 0.5.17:

* sm_12x: a backend with no sm_12x kernel is refused at startup with a clear
  message; a backend that works is accepted exactly as upstream accepts it.
* every other GPU: the outcome (resolved backends, or the exact error) is
  upstream's, cell for cell.

The expectations below are written from the kernels' arch support (see
docs/sm120.md), independently of the table in backend_support.py.
"""

import pytest

from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

GPU_NAME = "FAKE RTX PRO 6000 Blackwell"
CAPS = [(8, 0), (8, 9), (9, 0), (10, 0), (10, 3), (12, 0), (12, 1)]
KINDS = ["mla", "mha"]
SPEC = [False, True]

# What `--attention-backend X` must do on compute capability 12.x.
RUNS_ON_SM12X = {"triton", "flashinfer", "torch_native"}
RUNS_ON_SM12X_WITHOUT_SPEC = {"flex_attention"}  # no target-verify support
# Everything else 0.5.17 registers has no sm_12x kernel for a full
# prefill+decode backend (trtllm_mha: XQA decode only), serves another
# platform, or serves only DeepSeek sparse-attention models.
WORKING_ON_SM12X = ["triton", "flashinfer", "torch_native"]

# DFLASH's draft-backend resolution keeps these, else falls back to flashinfer.
_DFLASH_DRAFT_BACKENDS = {"flashinfer", "fa3", "fa4", "triton", "trtllm_mha", "ascend"}


def _registered():
    return sorted(ATTENTION_BACKENDS)


def _cells():
    return [
        {
            "cap": list(cap),
            "model": kind,
            "spec": spec,
            "args": {"attention_backend": backend},
        }
        for cap in CAPS
        for kind in KINDS
        for backend in _registered()
        for spec in SPEC
    ]


@pytest.fixture(scope="module")
def matrix(cell_runner):
    cells = _cells()
    return cells, cell_runner(cells)


def _label(cell):
    cap = ".".join(map(str, cell["cap"]))
    spec = "spec" if cell["spec"] else "nospec"
    return f"cap={cap} {cell['model']} {cell['args']['attention_backend']} {spec}"


def test_registry_is_enumerated_from_the_real_registry(matrix):
    _, res = matrix
    # The subprocesses saw the same registry as this process, and pristine
    # upstream registers exactly the same names (our series adds none).
    assert res["patched"]["registered"] == _registered()
    assert res["pristine"]["registered"] == _registered()
    assert len(_registered()) >= 20


def _expect_sm12x_accepts(backend, spec):
    return backend in RUNS_ON_SM12X or (
        backend in RUNS_ON_SM12X_WITHOUT_SPEC and not spec
    )


def test_sm12x_cells(matrix):
    cells, res = matrix
    failures = []
    for cell, got, upstream in zip(cells, res["patched"]["cells"], res["pristine"]["cells"]):
        if cell["cap"][0] != 12:
            continue
        backend = cell["args"]["attention_backend"]
        cap = tuple(cell["cap"])
        if _expect_sm12x_accepts(backend, cell["spec"]):
            if not got["ok"]:
                failures.append(f"{_label(cell)}: refused: {got['msg']}")
                continue
            if got != upstream:
                failures.append(f"{_label(cell)}: {got} differs from upstream {upstream}")
            if (got["prefill"], got["decode"]) != (backend, backend):
                failures.append(f"{_label(cell)}: resolved to {got}")
            if cell["spec"]:
                want_draft = backend if backend in _DFLASH_DRAFT_BACKENDS else "flashinfer"
                if got["draft"] != want_draft:
                    failures.append(f"{_label(cell)}: draft {got['draft']} != {want_draft}")
            continue
        # Refused, cleanly, naming the GPU, the reason and the way out.
        if got["ok"]:
            failures.append(f"{_label(cell)}: accepted {got}, expected a refusal")
            continue
        msg = got["msg"]
        wanted = [
            f"'{backend}'",
            GPU_NAME,
            f"compute capability {cap[0]}.{cap[1]}",
            f"sm_{cap[0]}{cap[1]}",
            "Reason: ",
            "Backends that work here: ",
            cell["model"].upper(),
            "--attention-backend",
        ]
        missing = [w for w in wanted if w not in msg]
        works = msg.split("Backends that work here: ", 1)[-1]
        missing += [b for b in WORKING_ON_SM12X if b not in works]
        if got["type"] != "UnsupportedAttentionBackendError" or missing:
            failures.append(f"{_label(cell)}: {got['type']}: {msg!r} lacks {missing}")
        if backend in works.split(" (")[0].split(", "):
            failures.append(f"{_label(cell)}: refused backend listed as working: {msg}")
    assert not failures, "\n".join(failures)


def test_no_sm12x_cell_accepts_a_backend_without_sm12x_kernels(matrix):
    cells, res = matrix
    accepted = {
        cell["args"]["attention_backend"]
        for cell, got in zip(cells, res["patched"]["cells"])
        if cell["cap"][0] == 12 and got["ok"]
    }
    assert accepted == RUNS_ON_SM12X | RUNS_ON_SM12X_WITHOUT_SPEC


def test_other_gpus_behave_exactly_like_upstream(matrix):
    cells, res = matrix
    diffs = [
        f"{_label(cell)}: patched {got} != upstream {upstream}"
        for cell, got, upstream in zip(cells, res["patched"]["cells"], res["pristine"]["cells"])
        if cell["cap"][0] != 12 and got != upstream
    ]
    assert not diffs, "\n".join(diffs)
    # And upstream itself accepts fa3 on Hopper, so the comparison is not vacuous.
    hopper_fa3 = [
        got
        for cell, got in zip(cells, res["patched"]["cells"])
        if tuple(cell["cap"]) == (9, 0) and cell["args"]["attention_backend"] == "fa3"
    ]
    assert hopper_fa3 and all(g["ok"] for g in hopper_fa3)
