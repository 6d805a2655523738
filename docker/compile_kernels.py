# SPDX-License-Identifier: Apache-2.0
"""Compile, without a GPU, every kernel the server JIT-compiles on sm_12x, and the project's.

The image ships no prebuilt FlashInfer or sglang JIT kernels: the server compiles them with
``$CUDA_HOME/bin/nvcc`` at start-up and on its first forwards. A toolchain that cannot build
them (an nvcc that does not match the runtime headers, a missing header or library) only
shows on a GPU host, minutes into the first start. This compiles the same modules here:

* every FlashInfer module in ``docker/jit_modules.json`` (``flashinfer``), for each arch in
  ``FLASHINFER_CUDA_ARCH_LIST`` (what the server itself targets; ``--flashinfer-arch`` adds
  more), each checked to generate the very module name the server loads;
* every sglang JIT kernel in the list (``sglang_jit``), through its own factory function with
  the JIT target forced to each ``--sglang-arch`` (the server targets the GPU it runs on:
  ``12.0f`` on sm_120, ``12.1a`` on sm_121);
* every Triton kernel configuration of this project (tree verify, DDTree build/compile) for
  ``--triton-arch``, with the shared-memory limit checked.

One line per module (``ok``/``FAIL``, seconds); exit 1 if anything failed, after the compiler's
own error for each failure. The toolchain check (``docker/cuda_home.py``) runs first.

  python docker/compile_kernels.py                  # everything, the image's archs
  python docker/compile_kernels.py --only flashinfer --list
  python docker/compile_kernels.py --compare-recorded rec.jsonl   # vs a GPU host's recording
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cuda_home  # noqa: E402  (sits beside this file, in the repo and in the image)

MODULES = HERE / "jit_modules.json"
KINDS = ("flashinfer", "sglang_jit", "triton")
SM120_SMEM = 101376  # 99 KiB: the most shared memory one block may use on sm_12x
_FA3_SUFFIX = "_sm90"  # FlashInfer's fa3 modules (sm_90 only); sm_12x builds the fa2 twin


def load_modules(path: pathlib.Path = MODULES) -> dict:
    data = json.loads(path.read_text())
    for kind in KINDS:
        if kind not in data:
            raise ValueError(f"{path}: no '{kind}' list")
    return data


def decode_arg(a):
    """JSON -> Python: {"dtype": "bfloat16"} is torch.bfloat16, the rest as is."""
    if isinstance(a, dict) and set(a) == {"dtype"}:
        import torch

        return getattr(torch, a["dtype"])
    return a


def resolve(ref: str):
    mod, _, attr = ref.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def sm120_name(recorded: str) -> str:
    """The module sm_12x builds where a host recorded ``recorded`` (fa3 -> its fa2 twin)."""
    return recorded[: -len(_FA3_SUFFIX)] if recorded.endswith(_FA3_SUFFIX) else recorded


def _report(kind: str, name: str, t0: float, err: str | None, results: list) -> None:
    dt = time.monotonic() - t0
    results.append({"kind": kind, "name": name, "ok": err is None, "seconds": round(dt, 1)})
    if err is None:
        print(f"ok    {kind:10s} {dt:6.1f} s  {name}", flush=True)
    else:
        print(f"FAIL  {kind:10s} {dt:6.1f} s  {name}", flush=True)
        print("\n".join("      | " + line for line in err.rstrip().splitlines()[-40:]), flush=True)


# ----------------------------------------------------------------------------- FlashInfer
def flashinfer_spec(entry: dict):
    """A listed FlashInfer module's JitSpec from its generator; ValueError when the generator
    makes another module than the one listed."""
    spec = resolve(entry["gen"])(*map(decode_arg, entry["args"]))
    if spec.name != entry["name"]:
        raise ValueError(f"{entry['gen']}{tuple(entry['args'])} generates {spec.name}, "
                         f"not the listed {entry['name']}")
    return spec


def compile_flashinfer(entries: list, results: list) -> None:
    """In this process: FLASHINFER_CUDA_ARCH_LIST and the workspace are already set."""
    for e in entries:
        t0 = time.monotonic()
        try:
            spec = flashinfer_spec(e)
            spec.build(verbose=False)
            if not spec.get_library_path().exists():
                raise RuntimeError(f"{spec.get_library_path()} was not built")
            err = None
        except Exception as ex:  # the compiler's message is the point of the report
            err = f"{type(ex).__name__}: {ex}"
        _report("flashinfer", e["name"], t0, err, results)


# ----------------------------------------------------------------------------- sglang JIT
def compile_sglang_jit(entries: list, arch: tuple[int, int], results: list) -> None:
    from sglang.kernels.jit.utils.arch import get_jit_cuda_arch, override_jit_cuda_arch

    with override_jit_cuda_arch(*arch):
        target = get_jit_cuda_arch().target_name
        for e in entries:
            label = f"{e['factory'].split(':')[1]}{tuple(e['args'])} [{target}]"
            t0 = time.monotonic()
            err = None
            build_dir = pathlib.Path(os.environ["TVM_FFI_CACHE_DIR"])
            before = set(build_dir.rglob("*.so")) if build_dir.exists() else set()
            try:
                kwargs = {k: decode_arg(v) for k, v in e.get("kwargs", {}).items()}
                resolve(e["factory"])(*map(decode_arg, e["args"]), **kwargs)
            except Exception as ex:
                # The module is built, then loaded: loading may need the driver library,
                # which a machine without a GPU does not have. A fresh .so means it compiled.
                fresh = set(build_dir.rglob("*.so")) - before
                if not (fresh and "libcuda.so" in str(ex)):
                    err = f"{type(ex).__name__}: {ex}"
            _report("sglang_jit", label, t0, err, results)


# ----------------------------------------------------------------------------- Triton
def ddtree_sources():
    """The DDTree build (from marginals and from a DFlash 2 selector), compile and step-commit
    kernels at the budgets their launch helpers serve, and the verify sampler's node-logits and
    Gumbel-draw kernels, as ``(label, ASTSource, compile options)``: the same for every arch."""
    import triton
    from triton.compiler import ASTSource

    from sglang.srt.speculative.ddtree.tree_build import MAX_BUDGET, _ddtree_build_kernel, _launch_config
    from sglang.srt.layers.attention.tree_verify.masks import mask_words
    from sglang.srt.speculative.ddtree.selector_tree import _selector_tree_kernel
    from sglang.srt.speculative.ddtree.tree_compile import _ddtree_compile_kernel

    # The tree from per-depth marginals, and from a DFlash 2 drafter's selector
    # (--speculative-ddtree-tree transitions): the same frontier and launch configuration.
    tree_out = dict(out_token_ptr="*i64", out_parent_ptr="*i32", out_depth_ptr="*i32", out_rank_ptr="*i32",
                    out_score_ptr="*fp32", out_num_ptr="*i32")
    builders = (
        ("ddtree_build", _ddtree_build_kernel,
         dict(lp_ptr="*fp32", ids_ptr="*i64", **tree_out, **{n: "i32" for n in (
             "stride_lp_b", "stride_lp_d", "stride_ids_b", "stride_ids_d", "stride_out_b", "num_depths", "k",
             "budget")})),
        ("ddtree_selector_tree", _selector_tree_kernel,
         dict(lp_ptr="*fp32", order_ptr="*i32", ids_ptr="*i64", **tree_out,
              **{n: "i32" for n in ("stride_out_b", "slots", "k", "width", "budget")})),
    )  # fmt: skip
    for name, fn, types in builders:
        for budget in sorted({1, 16, 64, 128, MAX_BUDGET}):
            frontier, num_warps = _launch_config(budget)
            sig = {n: ("constexpr" if n == "FRONTIER" else types[n]) for n in fn.arg_names}
            yield (f"{name} budget={budget}", ASTSource(fn, sig, constexprs={"FRONTIER": frontier}),
                   {"num_warps": num_warps})
    fn = _ddtree_compile_kernel
    types = {n: "*i64" for n in ("node_token_ptr", "bonus_ptr", "committed_ptr", "tokens_ptr",
                                 "positions_ptr", "parent_ptr", "retrive_index_ptr",
                                 "next_token_ptr", "next_sibling_ptr")}
    types.update(node_parent_ptr="*i32", node_depth_ptr="*i32", depth_ptr="*i32", mask_ptr="*i32",
                 req_to_token_ptr="*i32", req_pool_indices_ptr="*i64", cache_loc_ptr="*i64", stride_r2t="i32",
                 with_cache_loc="i32", budget="i32", max_depth="i32")
    for budget in sorted({1, 16, 64, MAX_BUDGET}):
        words = mask_words(budget + 1)
        consts = dict(BLOCK_I=32, BLOCK_J=64, WORDS=words, WORDS_PAD=triton.next_power_of_2(words))
        sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
        yield (f"ddtree_compile budget={budget}", ASTSource(fn, sig, constexprs=consts),
               {"num_warps": 4})
    from sglang.srt.speculative.ddtree.step_io import _ddtree_commit_kernel
    from sglang.srt.speculative.ddtree.tree_compile import max_tree_depth

    fn = _ddtree_commit_kernel
    types = {n: "*i64" for n in fn.arg_names if n.endswith("_ptr")}
    types.update(num_accepted_ptr="*i32", req_to_token_ptr="*i32", commit_lens_ptr="*i32", depth_ptr="*i32")
    types.update({n: "i32" for n in ("stride_accept", "stride_tokens", "stride_loc", "stride_r2t", "stride_depth",
                                     "stride_counts", "n", "width", "record_stats")})
    for budget in sorted({1, 16, 64, 128, MAX_BUDGET}):
        n, width = budget + 1, max_tree_depth(budget, 15) + 1  # a 16-token DFlash block: 15 depths
        # FROM_KERNEL: the greedy step reads sglang-kernel's int32 flat rows; the sampling step an AcceptResult.
        for from_kernel in (True, False):
            consts = dict(FROM_KERNEL=from_kernel, BLOCK_N=triton.next_power_of_2(n),
                          BLOCK_W=triton.next_power_of_2(width))
            sig = {a: ("constexpr" if a in consts else types[a]) for a in fn.arg_names}
            if from_kernel:  # accept_tokens_ptr is unused: the step passes the rows again
                sig.update(accept_index_ptr="*i32", accept_tokens_ptr="*i32", predicts_ptr="*i32")
            yield (f"ddtree_commit budget={budget} {'greedy kernel' if from_kernel else 'accept result'}",
                   ASTSource(fn, sig, constexprs=consts), {"num_warps": 1 if n <= 64 else 4})
    from sglang.srt.speculative.verify_sampling.node_logits import _BLOCK_V, _node_logits_kernel

    # DFLASH/DDTREE verify: each node's penalties along its root path and the logit bias, for a
    # vocabulary of at least one block (smaller ones compile at their own size on first use).
    fn = _node_logits_kernel
    types = {n: "i32" for n in fn.arg_names if not n.endswith("_ptr")}
    types.update(logits_ptr="*fp32", tokens_ptr="*i64", parent_ptr="*i64", depth_ptr="*i32", rows_ptr="*i32",
                 counts_ptr="*i32", out_len_ptr="*i32", freq_ptr="*fp32", pres_ptr="*fp32", rep_ptr="*fp32",
                 min_new_ptr="*i32", stop_ptr="*i32", bias_ptr="*fp32")
    for penalty, bias in ((True, True), (True, False), (False, True)):
        consts = dict(HAS_PENALTY=penalty, HAS_BIAS=bias, BLOCK=_BLOCK_V)
        sig = {a: ("constexpr" if a in consts else types[a]) for a in fn.arg_names}
        yield (f"verify_node_logits penalties={penalty} bias={bias}", ASTSource(fn, sig, constexprs=consts),
               {"num_warps": 4})
    from sglang.srt.speculative.verify_sampling import gumbel_draw

    # DFLASH/DDTREE verify: the unseeded draw, plain or filtered (a logit floor per row), one
    # row per program for a vocabulary of at least one block (smaller ones, several rows per
    # program, compile on first use).
    fn = gumbel_draw._gumbel_draw_kernel
    types = {n: "i32" for n in fn.arg_names if not n.endswith("_ptr")}
    types.update(logits_ptr="*fp32", temp_ptr="*fp32", floor_ptr="*fp32", out_ptr="*i64", seed_ptr="*i64")
    # The seed as a number (an eager step) or read from a tensor (a DDTREE step tail's graph).
    for floor in (False, True):
        for seed_from_ptr in (False, True):
            consts = dict(ROWS=1, BLOCK=gumbel_draw._BLOCK_V, HAS_FLOOR=floor, SEED_FROM_PTR=seed_from_ptr)
            sig = {a: ("constexpr" if a in consts else types[a]) for a in fn.arg_names}
            yield (f"verify_gumbel_draw floor={floor} seed_tensor={seed_from_ptr}", ASTSource(fn, sig, constexprs=consts),
                   {"num_warps": 4})
    from sglang.srt.speculative.verify_sampling import sampling_filters

    # DFLASH/DDTREE verify: each row's logit floor from its candidates (top-k 32, the top-p
    # candidates, the most the kernel holds), every filter on.
    fn = sampling_filters._floors_kernel
    types = {n: "i32" for n in fn.arg_names if not n.endswith("_ptr")}
    types.update(logits_ptr="*fp32", vals_ptr="*fp32", temp_ptr="*fp32", top_k_ptr="*i32", top_p_ptr="*fp32",
                 min_p_ptr="*fp32", floor_ptr="*fp32", decided_ptr="*i1")
    for block_k in (32, sampling_filters.TOP_P_CANDIDATES, sampling_filters.KERNEL_CANDIDATES):
        consts = dict(HAS_TOP_K=True, HAS_TOP_P=True, HAS_MIN_P=True, TOP_P_INCLUSIVE=False, TOP_P_OF_TOP_K_MASS=True,
                      BLOCK_K=block_k, BLOCK_V=sampling_filters._BLOCK_V)
        sig = {a: ("constexpr" if a in consts else types[a]) for a in fn.arg_names}
        yield (f"verify_sampling_floors candidates={block_k}", ASTSource(fn, sig, constexprs=consts), {"num_warps": 4})
    # ... and the search over the whole row for a row whose cut lies beyond its candidates.
    fn = sampling_filters._whole_row_floors_kernel
    types = {n: "i32" for n in fn.arg_names if not n.endswith("_ptr")}
    types.update(logits_ptr="*fp32", temp_ptr="*fp32", top_k_ptr="*i32", top_p_ptr="*fp32", min_p_ptr="*fp32",
                 floor_ptr="*fp32", decided_ptr="*i1")
    for min_p_path in (False, True):
        consts = dict(HAS_TOP_K=True, HAS_TOP_P=True, HAS_MIN_P=True, TOP_P_INCLUSIVE=False,
                      TOP_P_OF_TOP_K_MASS=min_p_path, SPLIT=sampling_filters._SPLIT,
                      PASSES=sampling_filters._SEARCH_PASSES, BLOCK_V=sampling_filters._SEARCH_BLOCK_V)
        sig = {a: ("constexpr" if a in consts else types[a]) for a in fn.arg_names}
        yield (f"verify_sampling_whole_row_floors top_k_mass={min_p_path}", ASTSource(fn, sig, constexprs=consts),
               {"num_warps": sampling_filters._SEARCH_WARPS})
    # ... that search split over several programs per row where the rows are few (its launches per
    # pass), at the slice counts row_slices gives 17, 263 and 1,088 rows of a 152k vocabulary on
    # 132 SMs (BLOCK_S 16 and 8).
    types.update(stats_ptr="*fp32", bounds_ptr="*i64", mass_ptr="*fp32", count_ptr="*i32", top_k_mass_ptr="*fp32",
                 low_ptr="*fp32")
    flags = dict(HAS_TOP_K=True, HAS_TOP_P=True, HAS_MIN_P=True, TOP_P_INCLUSIVE=False, TOP_P_OF_TOP_K_MASS=True,
                 SPLIT=sampling_filters._SPLIT, BLOCK_V=sampling_filters._SEARCH_BLOCK_V)
    kernels = [("lse", sampling_filters._slice_lse_kernel, {}),
               ("search", sampling_filters._slice_search_kernel, {"KTH": False}),
               ("kth_search", sampling_filters._slice_search_kernel, {"KTH": True}),
               ("top_k_mass", sampling_filters._slice_top_k_mass_kernel, {}),
               ("low", sampling_filters._slice_low_kernel, {})]
    import triton

    block_sizes = sorted({triton.next_power_of_2(sampling_filters.row_slices(rows, 152064, "cpu"))
                          for rows in (17, 263, 1088)})  # fmt: skip
    for block_s in block_sizes:
        for name, fn, extra in kernels:
            consts = dict(flags, BLOCK_S=block_s, **extra)
            t = {n: types.get(n, "i32") for n in fn.arg_names}
            sig = {a: ("constexpr" if a in consts else t[a]) for a in fn.arg_names}
            yield (f"verify_sampling_split_row_floors {name} slices<={block_s}", ASTSource(fn, sig, constexprs=consts),
                   {"num_warps": sampling_filters._SEARCH_WARPS})
        fn = sampling_filters._split_floors_kernel
        sig = {"decided_ptr": "*i1", "low_ptr": "*fp32", "floor_ptr": "*fp32", "parts": "i32", "BLOCK_S": "constexpr"}
        yield (f"verify_sampling_split_row_floors floors slices<={block_s}",
               ASTSource(fn, sig, constexprs={"BLOCK_S": block_s}), {"num_warps": 4})


def compile_triton(names: list, cap: tuple[int, int], results: list) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    tag = f"sm_{cap[0]}{cap[1]}"
    if "tree_verify" in names:
        from sglang.srt.layers.attention.tree_verify import aot

        t0 = time.monotonic()
        try:
            records = aot.compile_arch_report(cap)
            over = [r for r in records if r["shared"] > SM120_SMEM]
            err = f"over {SM120_SMEM} B of shared memory: {over}" if over else None
            label = f"tree_verify: {len(records)} kernel configurations [{tag}]"
        except Exception as ex:
            err, label = f"{type(ex).__name__}: {ex}", f"tree_verify [{tag}]"
        _report("triton", label, t0, err, results)
    if "ddtree" in names:
        for label, src, options in ddtree_sources():
            t0 = time.monotonic()
            try:
                c = triton.compile(src, target=GPUTarget("cuda", cap[0] * 10 + cap[1], 32), options=options)
                err = (f"{c.metadata.shared} B of shared memory" if c.metadata.shared > SM120_SMEM
                       else None)
            except Exception as ex:
                err = f"{type(ex).__name__}: {ex}"
            _report("triton", f"{label} [{tag}]", t0, err, results)
    unknown = set(names) - {"tree_verify", "ddtree"}
    if unknown:
        raise ValueError(f"unknown Triton kernel groups in {MODULES.name}: {sorted(unknown)}")


# ----------------------------------------------------------------------------- recorded lists
def compare_recorded(data: dict, recorded_path: pathlib.Path) -> int:
    """Every module a GPU host's server built must be in the list (sm_90's fa3 as its fa2 twin)."""
    listed_fi = {e["name"] for e in data["flashinfer"]}
    def key(e):
        return e["factory"], json.dumps(e["args"]), json.dumps(e.get("kwargs", {}), sort_keys=True)

    listed_sg = {key(e) for e in data["sglang_jit"]}
    missing, seen = [], 0
    for line in recorded_path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        seen += 1
        if rec["kind"] == "flashinfer":
            name = sm120_name(rec["name"])
            if name not in listed_fi:
                missing.append(f"flashinfer {name} (recorded as {rec['name']}; from {rec.get('caller')})")
        elif rec["kind"] == "sglang_jit":
            if key(rec) not in listed_sg:
                missing.append(f"sglang_jit {rec['factory']}{tuple(rec['args'])} (from {rec.get('caller')})")
    for m in sorted(set(missing)):
        print(f"MISSING  {m}")
    print(f"{seen} recorded builds, {len(set(missing))} not in {MODULES}")
    return 1 if missing else 0


# ----------------------------------------------------------------------------- driver
def _child(kind: str, arch: str, data: dict, out: pathlib.Path) -> int:
    results: list = []
    if kind == "flashinfer":
        compile_flashinfer(data["flashinfer"], results)
    elif kind == "sglang_jit":
        major, minor = (int(x) for x in arch.split("."))
        compile_sglang_jit(data["sglang_jit"], (major, minor), results)
    else:
        major, minor = (int(x) for x in arch.split("."))
        compile_triton(data["triton"], (major, minor), results)
    out.write_text(json.dumps(results))
    return 0


def _parse_list(text: str) -> list[str]:
    return [s for s in text.replace(",", " ").split() if s]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="compile_kernels.py", description=__doc__.splitlines()[0])
    ap.add_argument("--modules", type=pathlib.Path, default=MODULES)
    ap.add_argument("--only", default=",".join(KINDS), help="comma list of " + ", ".join(KINDS))
    ap.add_argument("--flashinfer-arch", default=os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "12.0f"),
                    help="FlashInfer targets, each built separately (default: "
                         "$FLASHINFER_CUDA_ARCH_LIST, as the server uses it)")
    ap.add_argument("--sglang-arch", default="12.0,12.1", help="compute capabilities for sglang's JIT kernels")
    ap.add_argument("--triton-arch", default="12.0,12.1", help="compute capabilities for the Triton kernels")
    ap.add_argument("--workdir", type=pathlib.Path, help="build caches (default: a temporary folder, removed)")
    ap.add_argument("--json", type=pathlib.Path, help="write every result here")
    ap.add_argument("--list", action="store_true", help="print the modules and exit")
    ap.add_argument("--compile-anyway", action="store_true",
                    help="compile even when the toolchain check fails (to see the compiler's errors)")
    ap.add_argument("--compare-recorded", type=pathlib.Path, metavar="JSONL",
                    help="check a GPU host's recording (scripts/gpu_host/record_jit_modules.py) against the list")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "ARCH", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        data = load_modules(args.modules)
    except (OSError, ValueError) as e:
        print(f"compile_kernels.py: error: {e}", file=sys.stderr)
        return 2
    if args.child:
        return _child(args.child[0], args.child[1], data, pathlib.Path(args.child[2]))
    if args.compare_recorded:
        return compare_recorded(data, args.compare_recorded)
    kinds = _parse_list(args.only)
    if set(kinds) - set(KINDS):
        print(f"compile_kernels.py: error: --only takes {', '.join(KINDS)}", file=sys.stderr)
        return 2
    if args.list:
        for e in data["flashinfer"] if "flashinfer" in kinds else []:
            print(f"flashinfer  {e['name']}  ({', '.join(e['for'])})")
        for e in data["sglang_jit"] if "sglang_jit" in kinds else []:
            print(f"sglang_jit  {e['factory']}{tuple(e['args'])}  ({', '.join(e['for'])})")
        for name in data["triton"] if "triton" in kinds else []:
            print(f"triton      {name}")
        return 0

    failed = False
    if {"flashinfer", "sglang_jit"} & set(kinds):
        home = pathlib.Path(os.environ.get("CUDA_HOME", "/opt/cuda"))
        try:
            print(f"toolchain: {cuda_home.check(home)}", flush=True)
        except (ValueError, OSError) as e:
            print(f"FAIL  toolchain: {e}", flush=True)
            failed = True
            if not args.compile_anyway:
                return 1

    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="ddtree-kernels-"))
    jobs = []
    for kind in kinds:
        archs = {"flashinfer": args.flashinfer_arch, "sglang_jit": args.sglang_arch,
                 "triton": args.triton_arch}[kind]
        jobs += [(kind, arch) for arch in _parse_list(archs)]
    results: list = []
    t_all = time.monotonic()
    for kind, arch in jobs:
        print(f"== {kind} [{arch}]", flush=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # Each job its own caches: nothing is reused from an earlier build or the image's.
        base = work / f"{kind}-{arch}"
        env.update(FLASHINFER_CUDA_ARCH_LIST=arch, FLASHINFER_WORKSPACE_BASE=str(base),
                   TVM_FFI_CACHE_DIR=str(base / "tvm-ffi"), TRITON_CACHE_DIR=str(base / "triton"))
        out = work / f"{kind}-{arch}.json"
        proc = subprocess.run([sys.executable, str(pathlib.Path(__file__).resolve()), "--modules",
                               str(args.modules), "--child", kind, arch, str(out)], env=env)
        if proc.returncode != 0 or not out.exists():
            print(f"FAIL  {kind} [{arch}]: the compile process exited with {proc.returncode}", flush=True)
            failed = True
            continue
        for r in json.loads(out.read_text()):
            r["arch"] = arch
            results.append(r)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.workdir is None:
        subprocess.run(["rm", "-rf", str(work)])
    bad = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(bad)} passed, {len(bad) + (1 if failed and not bad else 0)} failed "
          f"({time.monotonic() - t_all:.0f} s)")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
