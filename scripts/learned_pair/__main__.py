# SPDX-License-Identifier: Apache-2.0
"""``python3 -m scripts.learned_pair build|pack|unpack|show`` (run from the repository root).

  build  --out DIR [--pack-to DIR] [--deadline-s 480] [--profile h200|toy] [--seed 0]
         [--root LABEL=PATH ...] [--exclude PATH ...] [--log FILE] [--drafter dflash|dflash2|both]
         [--target-steps N --target-decay-start M --drafter-steps N --drafter-decay-start M]
  pack   PAIR --to DIR [--part-mib 15.5]
  unpack DIR [DIR ...] --to PAIR
  show   PAIR
  add-drafter PAIR [--kind dflash|dflash2] [--name NAME] [--init-from DIR] [--soft-labels W]
         [--temperatures 0,1] [--sequences N --new-tokens N --batch N --anchors N --lr X]
         [--deadline-s 300]   one more drafter for the pair's target, in drafter-NAME/
  offline PAIR [--drafter DIR] --sampling T[/top_k[/top_p[/min_p]]],... [--budgets 16,64] [--prompts 8]
         [--new-tokens 128] [--seed 0] [--dtype float32|bfloat16] [--out FILE]   accept lengths
                                   replayed with the torch models
         [--oracle [--stride 8] [--tree-temperatures T,...] [--draws M]]   instead: expected
                                   accept of the best tree from the target's own conditionals, of the
                                   drafter's tree and of its chain (and of drafts drawn from the drafter,
                                   verified by speculative / recursive rejection sampling)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path


def _roots(items):
    if not items:
        return None
    roots = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not Path(path).is_dir():
            raise SystemExit(f"--root {item!r}: expected LABEL=DIRECTORY (an existing directory)")
        roots[label] = Path(path)
    return roots


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m scripts.learned_pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="corpus, tokenizer, target, drafter, evaluation, files")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--pack-to", type=Path, help="also write the pair as parts (pair.tar.NN) here")
    b.add_argument("--deadline-s", type=float, default=480.0)
    b.add_argument("--profile", default="h200", choices=["h200", "toy"])
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--root", action="append", help="LABEL=DIR corpus root (default: this Python's stdlib "
                                                   "and site-packages)")
    b.add_argument("--exclude", action="append", default=[], type=Path)
    b.add_argument("--device")
    b.add_argument("--drafter", default="dflash", choices=["dflash", "dflash2", "both"],
                   help="dflash2: a DFlash 2 drafter (grouped convolution and candidate selector); both: "
                        "a DFlash drafter in drafter/ and a DFlash 2 one of the same target in drafter-dflash2/")
    b.add_argument("--log", type=Path, help="also append the build log here")
    for who in ("target", "drafter"):
        b.add_argument(f"--{who}-steps", type=int)
        b.add_argument(f"--{who}-decay-start", type=int)
    a = sub.add_parser("add-drafter", help="train one more drafter (e.g. DFlash 2) for a pair's target, into "
                                           "drafter-<kind>/ beside the pair's own")
    a.add_argument("pair", type=Path)
    a.add_argument("--kind", default="dflash2", choices=["dflash", "dflash2"])
    a.add_argument("--deadline-s", type=float, default=300.0)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--root", action="append", help="LABEL=DIR corpus root (default: this Python's stdlib "
                                                   "and site-packages, as build)")
    a.add_argument("--exclude", action="append", default=[], type=Path)
    a.add_argument("--device")
    a.add_argument("--drafter-steps", type=int)
    a.add_argument("--drafter-decay-start", type=int)
    a.add_argument("--name", help="directory drafter-NAME and manifest key drafter_NAME (default: the kind)")
    a.add_argument("--init-from", metavar="DIR", help="start from the weights of this drafter directory of the pair "
                                                      "(e.g. drafter), of the same kind and shape")
    a.add_argument("--soft-labels", type=float, default=0.0, metavar="W",
                   help="share of the loss against the target's whole next-token distribution instead of the "
                        "sequence's token (0: hard labels, as build; 1: distillation only)")
    a.add_argument("--temperatures", default="0,1",
                   help="temperatures the training sequences are generated at, row by row in turn (0 = greedy)")
    a.add_argument("--sequences", type=int, help="training sequences (default: the pair profile's)")
    a.add_argument("--new-tokens", type=int, help="generated tokens per training sequence (default: the profile's)")
    a.add_argument("--batch", type=int, help="sequences per training step (default: the profile's)")
    a.add_argument("--anchors", type=int, help="draft blocks per sequence per step (default: the profile's)")
    a.add_argument("--lr", type=float, help="peak learning rate (default: the profile's)")
    p = sub.add_parser("pack", help="split a pair directory into transportable parts")
    p.add_argument("pair", type=Path)
    p.add_argument("--to", type=Path, required=True)
    p.add_argument("--part-mib", type=float, default=15.5)
    u = sub.add_parser("unpack", help="reassemble parts (from one or more directories) into a pair directory")
    u.add_argument("dirs", type=Path, nargs="+")
    u.add_argument("--to", type=Path, required=True)
    s = sub.add_parser("show", help="print a pair's manifest summary")
    s.add_argument("pair", type=Path)
    o = sub.add_parser("offline", help="accept lengths of DFLASH and DDTREE replayed on the target's own "
                                       "continuations, per sampling setting")
    o.add_argument("pair", type=Path)
    o.add_argument("--drafter", default="drafter", metavar="DIR",
                   help="the pair's drafter directory to replay (e.g. drafter-dflash2 from add-drafter)")
    o.add_argument("--sampling", default="0,1,0.7/20/0.8")
    o.add_argument("--budgets", default="16,64")
    o.add_argument("--prompts", type=int, default=8)
    o.add_argument("--new-tokens", type=int, default=128)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--out", type=Path)
    o.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the models' dtype (the server runs bfloat16 on a GPU)")
    o.add_argument("--oracle", action="store_true",
                   help="the oracle bound: expected accept (exact, per setting and budget) of the best tree "
                        "built from the target's own conditionals, of the drafter's tree and of its chain, at "
                        "every --stride-th position of the target's continuations")
    o.add_argument("--stride", type=int, default=8, help="with --oracle: anchor spacing")
    o.add_argument("--tree-temperatures", default="",
                   help="with --oracle: also the drafter's tree built from its distribution at these "
                        "temperatures (comma-separated; the server builds it at 1)")
    o.add_argument("--draws", type=int, default=0, metavar="M",
                   help="with --oracle, at T > 0: also drafts drawn from the drafter's distribution (put through "
                        "the request's sampling), M per anchor: chains verified by speculative sampling, trees "
                        "of DDTree's shape by recursive rejection sampling")
    args = ap.parse_args(argv)

    from . import checkpoint

    if args.cmd == "build":
        from .build import BuildArgs, build

        for who in ("target", "drafter"):
            if getattr(args, f"{who}_decay_start") is not None and getattr(args, f"{who}_steps") is None:
                ap.error(f"--{who}-decay-start needs --{who}-steps")
        logf = open(args.log, "a") if args.log else None

        def log(msg):
            print(msg, flush=True)
            if logf:
                logf.write(msg + "\n")
                logf.flush()

        build(BuildArgs(out=args.out, profile=args.profile, seed=args.seed, deadline_s=args.deadline_s,
                        roots=_roots(args.root), exclude=args.exclude, device=args.device,
                        target_steps=args.target_steps, target_decay_start=args.target_decay_start,
                        drafter_steps=args.drafter_steps, drafter_decay_start=args.drafter_decay_start,
                        drafter=args.drafter), log)
        if args.pack_to:
            parts = checkpoint.pack(args.out, args.pack_to)
            log(f"packed into {len(parts)} parts in {args.pack_to}")
    elif args.cmd == "add-drafter":
        from .build import AddDrafterArgs, add_drafter

        if args.drafter_decay_start is not None and args.drafter_steps is None:
            ap.error("--drafter-decay-start needs --drafter-steps")
        try:
            temperatures = tuple(float(t) for t in args.temperatures.split(","))
        except ValueError:
            ap.error(f"--temperatures takes numbers, e.g. 0,1; got {args.temperatures!r}")
        add_drafter(AddDrafterArgs(pair=args.pair, kind=args.kind, seed=args.seed, deadline_s=args.deadline_s,
                                   roots=_roots(args.root), exclude=args.exclude, device=args.device,
                                   drafter_steps=args.drafter_steps, drafter_decay_start=args.drafter_decay_start,
                                   name=args.name, init_from=args.init_from, soft_labels=args.soft_labels,
                                   temperatures=temperatures, sequences=args.sequences, new_tokens=args.new_tokens,
                                   batch=args.batch, anchors=args.anchors, lr=args.lr))
    elif args.cmd == "pack":
        parts = checkpoint.pack(args.pair, args.to, args.part_mib)
        print(f"{len(parts)} parts in {args.to}")
    elif args.cmd == "unpack":
        print(checkpoint.unpack(args.dirs, args.to))
    elif args.cmd == "offline":
        import torch

        from . import evaluate
        from .tokenizer import MASK_ID

        try:
            tree_temperatures = [float(t) for t in args.tree_temperatures.split(",") if t]
        except ValueError:
            raise SystemExit(f"--tree-temperatures takes numbers, e.g. 0.7,1,1.4; got {args.tree_temperatures!r}")
        if any(not t > 0 for t in tree_temperatures) or (tree_temperatures and not args.oracle):
            raise SystemExit("--tree-temperatures takes positive temperatures, with --oracle")
        if args.draws < 0 or (args.draws and not args.oracle):
            raise SystemExit("--draws takes a count of draws per anchor, with --oracle")
        target, drafter = checkpoint.load_pair(args.pair, dtype=getattr(torch, args.dtype), drafter=args.drafter)
        target.eval(), drafter.eval()
        rows = [json.loads(line) for line in (args.pair / "prompts.jsonl").read_text().splitlines() if line.strip()]
        prompts = [r["prompt_ids"] for r in rows[: args.prompts]]
        budgets = [int(b) for b in args.budgets.split(",")]
        result = {"pair": str(args.pair), "drafter": args.drafter, "dtype": args.dtype,
                  "seed": args.seed, "date": time.strftime("%Y-%m-%d"),
                  "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
                  "torch_threads": torch.get_num_threads(), "argv": sys.argv[1:] if argv is None else list(argv), "settings": []}
        if args.oracle:
            result.update(oracle=True)
        for spec in args.sampling.split(","):
            if args.oracle:
                r = evaluate.oracle_accept(drafter, target, prompts, args.new_tokens, budgets, MASK_ID, args.seed,
                                           evaluate.Sampling.parse(spec), args.stride, tree_temperatures,
                                           args.draws)
            else:
                r = evaluate.offline_accept_sampled(drafter, target, prompts, args.new_tokens, budgets, MASK_ID,
                                                    args.seed, evaluate.Sampling.parse(spec))
            result["settings"].append(r)
            print(json.dumps(r), flush=True)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    elif args.cmd == "show":
        m = json.loads((args.pair / "manifest.json").read_text())
        keys = ["date", "device", "profile", "params", "corpus", "tokens", "heldout", "offline_accept_t0",
                "timings_s"]
        print(json.dumps({k: m.get(k) for k in keys}, indent=1))
        for k in ("target_train", "drafter_train"):
            r = m.get(k, {})
            print(k, {x: r.get(x) for x in ("steps", "decay_start", "wall_s", "final_loss", "tokens_per_s",
                                             "accuracy_by_offset") if x in r})
    return 0


if __name__ == "__main__":
    sys.exit(main())
