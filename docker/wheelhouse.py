# SPDX-License-Identifier: Apache-2.0
"""Wheelhouse tools for scripts/build_wheelhouse.sh and the image build (stdlib only).

Three jobs a plain `pip download` does not do:

* ``slim``: rewrite kernel wheels without the libraries the target GPUs can never load
  (sglang-kernel's FA3 library is 1.1 GB unpacked and runs only on compute capability 8.x/9.x;
  its loader picks ``sm90/`` on 9.0 and ``sm100/`` on every other GPU), dropping the files
  from the wheel's RECORD so that pip installs and uninstalls the result cleanly.
* ``requirements``: a ``--require-hashes`` requirements file for exactly the wheels present,
  so an air-gapped install takes nothing else.
* ``series-digest``: the digest of the patch series, as the apply tool writes into its stamp.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import pathlib
import re
import sys
import zipfile

# wheel file name: {name}-{version}(-{build})?-{python}-{abi}-{platform}.whl
_WHEEL_RE = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def wheel_name_version(filename: str) -> tuple[str, str]:
    m = _WHEEL_RE.match(filename)
    if not m:
        raise ValueError(f"not a wheel file name: {filename}")
    return normalize(m["name"]), m["version"]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_caps(text: str) -> list[tuple[int, int]]:
    """'12.0,12.1' -> [(12, 0), (12, 1)]; 'sm120' and 'sm_121' are accepted too."""
    caps = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        dotted = re.fullmatch(r"(\d+)\.(\d)", item)
        sm = re.fullmatch(r"sm_?(\d+)(\d)[af]?", item.lower())
        if not (dotted or sm):
            raise ValueError(f"bad compute capability '{item}': use e.g. 12.0 or sm120")
        m = dotted or sm
        caps.append((int(m[1]), int(m[2])))
    if not caps:
        raise ValueError("no compute capability given")
    return caps


def unusable_paths(dist: str, caps: list[tuple[int, int]]) -> list[str]:
    """Path prefixes inside a wheel that no GPU in `caps` can load (empty: keep all)."""
    if dist != "sglang-kernel":
        return []
    drop = []
    # sgl_kernel/load_utils.py: capability 9.0 loads sm90/common_ops, anything else sm100/.
    if (9, 0) not in caps:
        drop.append("sgl_kernel/sm90/")
    if all(c == (9, 0) for c in caps):
        drop.append("sgl_kernel/sm100/")
    # FA3 (flash_ops) is built for sm80-sm90 only; sglang gates it on major 8 or 9.
    if all(major not in (8, 9) for major, _ in caps):
        drop.append("sgl_kernel/flash_ops")
    return drop


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def slim_wheel(path: pathlib.Path, drop: list[str]) -> tuple[int, list[str]]:
    """Rewrite `path` in place without members under `drop`; returns (bytes saved, dropped)."""
    with zipfile.ZipFile(path) as src:
        infos = src.infolist()
        dropped = [i.filename for i in infos if any(i.filename.startswith(p) for p in drop)]
        if not dropped:
            return 0, []
        records = [i for i in infos if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename)]
        if len(records) != 1:
            raise ValueError(f"{path.name}: expected one dist-info/RECORD, found {len(records)}")
        record_name = records[0].filename
        gone = set(dropped)
        rows = list(csv.reader(io.StringIO(src.read(record_name).decode())))
        kept_rows = [r for r in rows if r and r[0] not in gone]
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(kept_rows)
        tmp = path.with_suffix(".whl.partial")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in infos:
                if info.filename in gone:
                    continue
                data = buf.getvalue().encode() if info.filename == record_name else src.read(info)
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    before = path.stat().st_size
    os.replace(tmp, path)
    return before - path.stat().st_size, dropped


def verify_record(path: pathlib.Path) -> None:
    """Check every member against RECORD, as pip does on install; raise on any mismatch."""
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        record_name = next(n for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n))
        listed = {}
        for row in csv.reader(io.StringIO(z.read(record_name).decode())):
            if row:
                listed[row[0]] = row[1]
        for name in names:
            if name.endswith("/"):
                continue
            if name not in listed:
                raise ValueError(f"{path.name}: {name} is not in RECORD")
            if name != record_name and listed[name] != _record_hash(z.read(name)):
                raise ValueError(f"{path.name}: {name} does not match its RECORD hash")
        missing = [n for n in listed if n not in names]
        if missing:
            raise ValueError(f"{path.name}: RECORD lists missing files: {missing[:3]}")


def write_requirements(wheelhouse: pathlib.Path, out) -> int:
    wheels = sorted(wheelhouse.glob("*.whl"))
    seen: dict[str, str] = {}
    for w in wheels:
        name, version = wheel_name_version(w.name)
        if name in seen:
            raise ValueError(f"two wheels for {name} in {wheelhouse}: {seen[name]} and {w.name}")
        seen[name] = w.name
        out.write(f"{name}=={version} \\\n    --hash=sha256:{sha256_of(w)}\n")
    return len(wheels)


def series_digest(repo: pathlib.Path) -> str:
    sys.path.insert(0, str(repo / "scripts"))
    from patchkit.series import load_series  # the apply tool's own definition

    series = load_series(repo / "patches", repo / "sglang")
    return series.digest("copy")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="wheelhouse.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slim", help="drop libraries the target GPUs cannot load")
    s.add_argument("wheelhouse", type=pathlib.Path)
    s.add_argument("--gpu-arch", required=True, help="compute capabilities, e.g. 12.0,12.1")
    r = sub.add_parser("requirements", help="print a --require-hashes requirements file")
    r.add_argument("wheelhouse", type=pathlib.Path)
    d = sub.add_parser("series-digest", help="print the patch series digest")
    d.add_argument("--repo", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parents[1])
    args = ap.parse_args(argv)

    try:
        if args.cmd == "slim":
            caps = parse_caps(args.gpu_arch)
            for w in sorted(args.wheelhouse.glob("*.whl")):
                drop = unusable_paths(wheel_name_version(w.name)[0], caps)
                if not drop:
                    continue
                saved, dropped = slim_wheel(w, drop)
                verify_record(w)
                print(f"slimmed {w.name}: -{saved / 2**20:.0f} MiB ({len(dropped)} files under "
                      f"{', '.join(drop)})")
        elif args.cmd == "requirements":
            n = write_requirements(args.wheelhouse, sys.stdout)
            print(f"{n} wheels", file=sys.stderr)
        elif args.cmd == "series-digest":
            print(series_digest(args.repo))
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
