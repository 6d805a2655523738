#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Two-sample test of the served sampler: speculative decoding must sample what the target
samples alone. Thousands of continuations of one prompt from a server without speculation
and from DFLASH / DDTREE servers of the same target; for each generated position the token
counts of the two samples are compared (chi-square test of homogeneity), and so are the
joint first tokens (pairs, triples). One family of tests per run, Bonferroni-corrected, so
the run rejects with probability at most ``alpha`` when every server samples the target's
distribution. A second sample from the no-speculation server is compared with the first as
a control, and a sample drawn at a slightly wrong temperature (``BIASED``: what a verify
that sharpens or flattens the target would sample) must be rejected, so the run shows it
can fail. ``detectable_shift`` is the smallest change of one token's probability the family
detects with 80 % power at the sample size used (for the worst-case probability 0.5).

Categories seen fewer than ``MIN_TOTAL`` times in both samples together are pooled into one
bin (merged into the smallest bin when the pool itself is too small); the pooling looks only
at the combined counts, not at which sample a token came from, so it does not bias the test.
With equal sample sizes every remaining cell expects at least ``MIN_TOTAL / 2`` counts.

Against running servers (native ``/generate`` with token ids):
  python3 benchmarks/sampling_check.py --server nospec=http://127.0.0.1:30000 \\
      --server ddtree16=http://127.0.0.1:30002 --prompt-ids prompts.json --samples 3000 --out results/x.json
``prompts.json``: a JSON list of token-id lists, or of objects with ``prompt_ids``.
``benchmarks/budget_sweep.py --launch --sampling-check`` runs it on the servers it started.
``--samples-out FILE`` keeps the drawn samples; ``--replay FILE`` judges them again (with
``--target``, where the target's logits decide the filters: ``sampling_boundaries``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

from benchmarks import sampling_boundaries as sb

MIN_TOTAL = 10
#: The sampling settings checked: what chat clients send (Qwen's recommended top-k with top-p,
#: plus min-p) and plain T=1 with a repetition penalty (penalties along each tree path).
SETTINGS = [
    {"name": "T0.7-top_k20-top_p0.8-min_p0.05", "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05},
    {"name": "T1-repetition_penalty1.1", "temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.1},
]
#: ``parse_settings`` keys: the request's sampling parameter and its type.
SETTING_KEYS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float,
                "frequency_penalty": float, "presence_penalty": float}
#: Tokens per position whose counts a comparison records (the base sample's most frequent).
TOP_COUNTS = 6
#: The deliberately biased control: no speculation at this multiple of the setting's temperature.
BIASED = 1.1
BIASED_LABEL = f"nospec at {BIASED}x temperature (must differ)"


def parse_settings(text: str) -> list[dict]:
    """``temperature=0.7:top_k=20:top_p=0.8,temperature=1`` -> settings like ``SETTINGS`` (named
    after their parameters); ``default`` stands for ``SETTINGS``."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item == "default":
            out += SETTINGS
            continue
        setting = {}
        for part in item.split(":"):
            key, sep, value = part.partition("=")
            if not sep or key not in SETTING_KEYS:
                raise ValueError(f"sampling setting {item!r}: expected KEY=VALUE[:KEY=VALUE...] with KEY one of "
                                 f"{', '.join(SETTING_KEYS)}")
            try:
                setting[key] = SETTING_KEYS[key](value)
            except ValueError as e:
                raise ValueError(f"sampling setting {item!r}: {key}={value!r} is not a number") from e
        if "temperature" not in setting:
            raise ValueError(f"sampling setting {item!r} needs a temperature")
        out.append({"name": "-".join(f"{k}{v}" for k, v in setting.items()), **setting})
    if not out:
        raise ValueError(f"no sampling settings in {text!r}")
    return out


# ---------------------------------------------------------------------------------------------
# Statistics


def homogeneity(a: Counter, b: Counter, min_total: int = MIN_TOTAL) -> dict:
    """Pearson chi-square test that two samples of categories come from one distribution."""
    from scipy.stats import chi2

    totals = Counter(a) + Counter(b)
    big = sorted((c for c in totals if totals[c] >= min_total), key=lambda c: (-totals[c], str(c)))
    small = [c for c in totals if totals[c] < min_total]
    rows_a = [a.get(c, 0) for c in big]
    rows_b = [b.get(c, 0) for c in big]
    pooled_a, pooled_b = sum(a.get(c, 0) for c in small), sum(b.get(c, 0) for c in small)
    if pooled_a + pooled_b >= min_total or not big:
        rows_a.append(pooled_a)
        rows_b.append(pooled_b)
    elif pooled_a + pooled_b:
        rows_a[-1] += pooled_a
        rows_b[-1] += pooled_b
    cells = [(x, y) for x, y in zip(rows_a, rows_b) if x + y > 0]
    na, nb = sum(x for x, _ in cells), sum(y for _, y in cells)
    if len(cells) < 2 or na == 0 or nb == 0:
        return {"stat": 0.0, "df": 0, "p": 1.0, "bins": len(cells)}
    n = na + nb
    stat = 0.0
    for x, y in cells:
        t = x + y
        ea, eb = na * t / n, nb * t / n
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    df = len(cells) - 1
    return {"stat": stat, "df": df, "p": float(chi2.sf(stat, df)), "bins": len(cells)}


def compare(sa: Sequence[Sequence[int]], sb: Sequence[Sequence[int]], positions: int,
            joint: Sequence[int] = (2, 3)) -> list[dict]:
    """The tests between two samples of continuations: one per position, one per joint prefix."""
    tests = []
    for k in range(positions):
        ca = Counter(s[k] for s in sa if len(s) > k)
        cb = Counter(s[k] for s in sb if len(s) > k)
        tests.append({"what": f"position {k + 1}", **homogeneity(ca, cb)})
    for j in joint:
        ca = Counter(tuple(s[:j]) for s in sa if len(s) >= j)
        cb = Counter(tuple(s[:j]) for s in sb if len(s) >= j)
        tests.append({"what": f"first {j} tokens", **homogeneity(ca, cb)})
    return tests


def top_counts(sa: Sequence[Sequence[int]], sb: Sequence[Sequence[int]], positions: int,
               top: int = TOP_COUNTS) -> list[list[list[int]]]:
    """Per position, ``[token, count in sa, count in sb]`` for the ``top`` tokens most frequent in
    ``sa``: which way a rejected comparison leans."""
    out = []
    for k in range(positions):
        ca = Counter(s[k] for s in sa if len(s) > k)
        cb = Counter(s[k] for s in sb if len(s) > k)
        out.append([[tok, n, cb.get(tok, 0)] for tok, n in ca.most_common(top)])
    return out


def detectable_shift(samples: int, tests: int, alpha: float, power: float = 0.8) -> float:
    """Smallest shift of one token's probability (around 0.5, the worst case) that a two-sided
    two-sample test at the family's per-test level detects with ``power``."""
    from scipy.stats import norm

    z = norm.isf(alpha / (2 * max(1, tests))) + norm.isf(1 - power)
    return float(z * (2 * 0.25 / max(1, samples)) ** 0.5)


def family_verdict(tests: list[dict], alpha: float) -> dict:
    m = max(1, len(tests))
    p_min = min((t["p"] for t in tests), default=1.0)
    return {"tests": m, "alpha": alpha, "per_test_alpha": alpha / m, "min_p": p_min,
            "min_p_bonferroni": min(1.0, p_min * m), "reject": p_min < alpha / m}


# ---------------------------------------------------------------------------------------------
# Drawing samples from a server


def _cutter(decided_at: dict, positions: int):
    """Samples cut at their first undecided context; the first token is drawn from the
    prefill's logits in every server, so its context counts as decided whatever its margins."""
    decided_at = {**decided_at, (): True}
    return lambda samples: sb.truncate_undecided(samples, decided_at, positions)


def draw(server, prompt_ids: list[int], n: int, new_tokens: int, setting: dict, chunk: int = 250,
         threads: int = 4) -> list[list[int]]:
    """``n`` continuations of ``new_tokens`` tokens, as batched native /generate requests."""
    params = {k: v for k, v in setting.items() if k != "name"}
    params.update(max_new_tokens=new_tokens, ignore_eos=True)

    def one(k):
        out = server.post("/generate", {"input_ids": [prompt_ids] * k, "sampling_params": params})
        out = out if isinstance(out, list) else [out]
        return [list(o["output_ids"])[:new_tokens] for o in out]

    sizes = [min(chunk, n - i) for i in range(0, n, chunk)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return [s for part in pool.map(one, sizes) for s in part]


def run_check(servers: dict, prompts: list[list[int]], samples: int = 3000, positions: int = 8,
              alpha: float = 0.01, settings: Optional[list[dict]] = None, deadline_s: Optional[float] = None,
              log=print, concurrency: int = 1000, decided: Optional[Callable] = None,
              samples_out: Optional[Path] = None, controls_every_prompt: bool = False) -> dict:
    """``servers``: label -> object with ``post(path, body)``; must include ``nospec``.
    ``concurrency``: continuations in flight per server (the batch the servers decode).
    ``decided``: see ``judge``. ``samples_out``: where the drawn samples are kept
    (``save_samples``), so that ``main --replay`` can judge them again.
    The two controls (a second no-speculation sample and the biased one) are drawn with the
    first prompt of each setting only, unless ``controls_every_prompt``: they show that the
    test holds its level and can fail, which one prompt shows as well as many, and they are
    two of the draws a prompt costs."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    chunk = min(250, concurrency)
    threads = max(1, concurrency // chunk)

    def draw_from(server, prompt, setting):
        return draw(server, prompt, samples, positions, setting, chunk, threads)

    if "nospec" not in servers:
        raise ValueError("the sampling check needs a no-speculation server (label nospec)")
    t0 = time.monotonic()
    settings = settings or SETTINGS
    others = [label for label in servers if label != "nospec"]
    drawn, skipped = [], []
    per_draw = None
    for setting in settings:
        with_controls = True  # until a prompt of this setting has drawn them
        for pi, prompt in enumerate(prompts):
            controls = 2 if with_controls or controls_every_prompt else 0
            need = (1 + controls + len(others)) * (per_draw or 0)
            if deadline_s is not None and time.monotonic() - t0 + need > deadline_s:
                skipped.append({"setting": setting["name"], "prompt": pi, "reason": "deadline"})
                continue
            t = time.monotonic()
            base = draw_from(servers["nospec"], prompt, setting)
            per_draw = time.monotonic() - t
            # The first draw is the estimate: a prompt that cannot finish in time is left out
            # with what it would need, not run past the deadline.
            rest = (controls + len(others)) * per_draw
            if deadline_s is not None and time.monotonic() - t0 + rest > deadline_s:
                skipped.append({"setting": setting["name"], "prompt": pi,
                                "reason": f"deadline: one draw took {per_draw:.0f} s, the prompt needs {rest:.0f} s more"})
                continue
            pairs = []
            if controls:
                biased = {**setting, "temperature": setting["temperature"] * BIASED}
                pairs += [("nospec (second sample)", draw_from(servers["nospec"], prompt, setting)),
                          (BIASED_LABEL, draw_from(servers["nospec"], prompt, biased))]
                with_controls = False
            for label in others:
                pairs.append((label, draw_from(servers[label], prompt, setting)))
            drawn.append({"setting": setting, "prompt": pi, "base": base, "pairs": pairs})
    if samples_out is not None:
        save_samples(drawn, samples_out, positions)
    out = {"samples": samples, "positions": positions, "alpha": alpha, "prompts": len(prompts),
           "concurrency": chunk * threads, "settings": settings,
           "controls": "every prompt" if controls_every_prompt else "first prompt of each setting",
           **judge(drawn, samples, positions, alpha, decided, log), "skipped": skipped}
    out["wall_s"] = time.monotonic() - t0
    return out


def judge(drawn: list[dict], samples: int, positions: int, alpha: float, decided: Optional[Callable] = None,
          log=print) -> dict:
    """The tests, the verdict and its power from drawn samples: ``drawn`` holds, per setting and
    prompt, the no-speculation sample (``base``) and the ``(label, sample)`` pairs compared with it.

    ``decided(prompt_index, samples, setting)``: ``prefix -> bool``, whether the target's logits
    decide the setting's filters at that context (``sampling_boundaries``); when given, every
    sample is cut at its first undecided context after the first token and the verdict rests on
    those tests, the tests over every context kept beside them (``tests_all_contexts``)."""
    out = {"comparisons": []}
    for rec in drawn:
        setting, pi, base, pairs = rec["setting"], rec["prompt"], rec["base"], rec["pairs"]
        cut = (lambda x: x) if decided is None else _cutter(decided(pi, [base] + [o for _, o in pairs], setting),
                                                              positions)
        for label, other in pairs:
            entry = {"setting": setting["name"], "prompt": pi, "server": label,
                     "tests": compare(cut(base), cut(other), positions),
                     "distinct_first_tokens": len({s[0] for s in other}),
                     "top_counts": top_counts(base, other, min(3, positions))}
            if decided is not None:
                entry["tests_all_contexts"] = compare(base, other, positions)
                entry["decided_share"] = {"nospec": sb.decided_share(cut(base), positions),
                                          label: sb.decided_share(cut(other), positions)}
            out["comparisons"].append(entry)
            worst = min(entry["tests"], key=lambda x: x["p"])
            log(f"[sampling] {setting['name']} prompt {pi} {label}: min p {worst['p']:.3g} ({worst['what']})")
    all_tests = [t for c in out["comparisons"] for t in c["tests"] if c["server"] != BIASED_LABEL]
    out["verdict"] = family_verdict(all_tests, alpha)
    out["detectable_shift"] = detectable_shift(samples, len(all_tests), alpha)
    controls = [c for c in out["comparisons"] if c["server"] == BIASED_LABEL]
    # Power: every biased sample is told apart at the family's own per-test level.
    out["biased_rejected"] = bool(controls) and all(
        min(t["p"] for t in c["tests"]) < out["verdict"]["per_test_alpha"] for c in controls)
    rejected = [(c["setting"], c["prompt"], c["server"], t["what"], t["p"]) for c in out["comparisons"]
                for t in c["tests"] if t["p"] < out["verdict"]["per_test_alpha"] and c["server"] != BIASED_LABEL]
    out["rejected"] = [dict(zip(("setting", "prompt", "server", "test", "p"), r)) for r in rejected]
    log(f"[sampling] {len(all_tests)} tests, min p {out['verdict']['min_p']:.3g}, "
        f"{'REJECT' if out['verdict']['reject'] else 'no difference'} at family alpha {alpha}; detects a "
        f"{out['detectable_shift']:.3f} shift; biased control {'rejected' if out['biased_rejected'] else 'NOT rejected'}")
    return out


def save_samples(drawn: list[dict], path: Path, positions: int) -> None:
    """The drawn samples as one compressed NumPy archive (token ids, int32 ``[n, positions]``,
    -1 past a short continuation) with what ``load_samples`` needs to put them back."""
    import numpy as np

    arrays, index = {}, []
    for r, rec in enumerate(drawn):
        labels = ["nospec"] + [label for label, _ in rec["pairs"]]
        for j, sample in enumerate([rec["base"]] + [s for _, s in rec["pairs"]]):
            a = np.full((len(sample), positions), -1, dtype=np.int32)
            for i, s in enumerate(sample):
                a[i, : min(len(s), positions)] = s[:positions]
            arrays[f"r{r}_{j}"] = a
        index.append({"setting": rec["setting"], "prompt": rec["prompt"], "labels": labels})
    meta = json.dumps({"positions": positions, "records": index})
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=np.array(meta), **arrays)


def load_samples(path: Path) -> tuple[list[dict], int]:
    """``save_samples``'s records and positions."""
    import numpy as np

    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        drawn = []
        for r, rec in enumerate(meta["records"]):
            samples = [[[int(t) for t in row if t >= 0] for row in z[f"r{r}_{j}"]] for j in range(len(rec["labels"]))]
            drawn.append({"setting": rec["setting"], "prompt": rec["prompt"], "base": samples[0],
                          "pairs": list(zip(rec["labels"][1:], samples[1:]))})
    return drawn, meta["positions"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", help="LABEL=URL; one must be nospec")
    ap.add_argument("--replay", type=Path, help="judge the samples a run kept (--samples-out) instead of drawing")
    ap.add_argument("--prompt-ids", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--positions", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=0.01)
    ap.add_argument("--settings", default="default", help="KEY=VALUE[:KEY=VALUE...] per setting, comma-separated "
                    "(keys: " + ", ".join(SETTING_KEYS) + "); default: " + ", ".join(s["name"] for s in SETTINGS))
    ap.add_argument("--concurrency", type=int, default=1000, help="continuations in flight per server")
    ap.add_argument("--target", help="the target's checkpoint (transformers): test only where its logits decide the "
                    "filters (benchmarks/sampling_boundaries.py)")
    ap.add_argument("--boundary-delta", type=float, default=0.0625, help="with --target: logit tolerance")
    ap.add_argument("--boundary-mass", type=float, default=0.02, help="with --target: top-p mass tolerance")
    ap.add_argument("--sampling-backend", default="flashinfer", help="with --target: the servers' sampling backend "
                    "(the order of the filters)")
    ap.add_argument("--samples-out", type=Path, help="keep the drawn samples here (.npz) for --replay")
    ap.add_argument("--controls-every-prompt", action="store_true", help="draw the two controls with every prompt "
                    "(default: with the first prompt of each setting)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if bool(args.server) == bool(args.replay):
        ap.error("give the servers to draw from (--server) or a kept run to judge (--replay), not both or neither")
    if args.concurrency < 1:
        ap.error("--concurrency takes a positive number")
    try:
        settings = parse_settings(args.settings)
    except ValueError as e:
        ap.error(str(e))
    drawn = None
    if args.replay:
        try:
            drawn, args.positions = load_samples(args.replay)
        except (OSError, ValueError, KeyError) as e:
            ap.error(f"--replay {args.replay}: not a kept sampling check ({e})")
        settings = [r["setting"] for r in drawn]
    raw = json.loads(args.prompt_ids.read_text())
    prompts = [p["prompt_ids"] if isinstance(p, dict) else p for p in raw]
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(i, int) for i in p) for p in prompts):
        ap.error(f"{args.prompt_ids}: expected a list of token-id lists (or objects with prompt_ids)")
    decided = None
    if args.target:
        try:
            for setting in settings:
                sb.has_cut(setting, 1 << 30)
            decided = sb.DecidedContexts(sb.load_target(args.target), prompts, args.positions, args.boundary_delta,
                                         args.boundary_mass, args.sampling_backend)
        except ValueError as e:
            ap.error(f"--target: {e}")
    if drawn is not None:
        if max(r["prompt"] for r in drawn) >= len(prompts):
            ap.error(f"--replay {args.replay} holds prompts {args.prompt_ids} does not have")
        samples = len(drawn[0]["base"]) if drawn else 0
        result = {"samples": samples, "positions": args.positions, "alpha": args.alpha, "prompts": len(prompts),
                  "replayed": str(args.replay), "settings": settings,
                  **judge(drawn, samples, args.positions, args.alpha, decided)}
    else:
        budget_sweep = sys.modules.get("budget_sweep")
        if budget_sweep is None:
            import importlib.util

            spec = importlib.util.spec_from_file_location("budget_sweep", Path(__file__).with_name("budget_sweep.py"))
            budget_sweep = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(budget_sweep)
        servers = {}
        for item in args.server:
            label, sep, url = item.partition("=")
            if not sep:
                ap.error(f"--server {item!r}: expected LABEL=URL")
            servers[label] = budget_sweep.Server(label, url)
        result = run_check(servers, prompts, args.samples, args.positions, args.alpha, settings,
                           concurrency=args.concurrency, decided=decided, samples_out=args.samples_out,
                           controls_every_prompt=args.controls_every_prompt)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["verdict"]["reject"] or not result["biased_rejected"] else 0


if __name__ == "__main__":
    sys.exit(main())
