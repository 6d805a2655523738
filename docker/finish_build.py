# SPDX-License-Identifier: Apache-2.0
"""Last step of the image build: prove the series is what got applied, record the build.

Fails the build when the stamp that scripts/apply_patches.sh wrote into the installed sglang
does not match the series shipped in the image, when the caller's expected digest or upstream
version differ, and writes /opt/ddtree/build.json for the entrypoint and the doctor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import sysconfig

import wheelhouse  # beside this file (run by path, so its directory is sys.path[0])

STAMP = "sglang/.ddtree-series.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="finish_build.py")
    ap.add_argument("--src", type=pathlib.Path, required=True, help="repo files shipped in the image")
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--gpu-arch", required=True)
    ap.add_argument("--expect-digest", default="")
    ap.add_argument("--expect-upstream", default="")
    ap.add_argument("--base-image", default="")
    ap.add_argument("--vcs-ref", default="")
    args = ap.parse_args(argv)

    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    stamp_path = site / STAMP
    if not stamp_path.exists():
        return _fail(f"{stamp_path} is missing: the patch series was not applied")
    stamp = json.loads(stamp_path.read_text())
    digest = wheelhouse.series_digest(args.src)
    if stamp.get("digest") != digest:
        return _fail(f"patch stamp {stamp.get('digest')} != series {digest} shipped in {args.src}")
    if args.expect_digest and args.expect_digest != digest:
        return _fail(f"SERIES_DIGEST={args.expect_digest} was given, but the build context's "
                     f"series is {digest}")
    upstream = stamp.get("upstream_version", "")
    if args.expect_upstream and args.expect_upstream != upstream:
        return _fail(f"UPSTREAM_VERSION={args.expect_upstream} was given, but upstream.lock "
                     f"pins {upstream}")
    caps = wheelhouse.parse_caps(args.gpu_arch)
    info = {
        "upstream_version": upstream,
        "series_digest": digest,
        "patches": [p["name"] for p in stamp.get("patches", [])],
        "overlay_files": len(stamp.get("overlay", [])),
        "gpu_arch": ",".join(f"{a}.{b}" for a, b in caps),
        "dropped": wheelhouse.unusable_paths("sglang-kernel", caps),
        "base_image": args.base_image,
        "vcs_ref": args.vcs_ref,
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "site_packages": str(site),
    }
    args.out.write_text(json.dumps(info, indent=1) + "\n")
    print(f"series {digest[:12]} ({len(info['patches'])} patches, {info['overlay_files']} overlay "
          f"files) applied to sglang {upstream}; GPU arch {info['gpu_arch']}")
    return 0


def _fail(msg: str) -> int:
    print(f"finish_build: error: {msg}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
