# SPDX-License-Identifier: Apache-2.0
"""docker/wheelhouse.py: which kernel libraries each GPU set can drop, wheel rewriting, hashes.

The slim test builds a wheel laid out like sglang-kernel 0.4.5 (the real one is 383 MB, too
big for CI), rewrites it, and installs the result with the real pip.
"""

import base64
import csv
import hashlib
import importlib.util
import io
import pathlib
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("ddtree_wheelhouse", REPO / "docker" / "wheelhouse.py")
wh = importlib.util.module_from_spec(_spec)
sys.modules["ddtree_wheelhouse"] = wh
_spec.loader.exec_module(wh)

KERNEL_FILES = {
    "sgl_kernel/__init__.py": b"from sgl_kernel.version import __version__\n",
    "sgl_kernel/version.py": b'__version__ = "0.4.5"\n',
    "sgl_kernel/flash_ops.abi3.so": b"\x7fELF fa3" * 4096,
    "sgl_kernel/flashmla_ops.abi3.so": b"\x7fELF mla" * 64,
    "sgl_kernel/sm90/common_ops.abi3.so": b"\x7fELF sm90" * 512,
    "sgl_kernel/sm100/common_ops.abi3.so": b"\x7fELF sm100" * 512,
}


def _record_hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(directory, files, name="sglang_kernel", version="0.4.5",
               tag="cp310-abi3-manylinux2014_x86_64"):
    dist = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: cp310-abi3-manylinux2014_x86_64\n"
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for path, data in files.items():
        w.writerow([path, _record_hash(data), len(data)])
    w.writerow([f"{dist}/RECORD", "", ""])
    files[f"{dist}/RECORD"] = buf.getvalue().encode()
    path = pathlib.Path(directory) / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for p, data in files.items():
            z.writestr(p, data)
    return path


@pytest.mark.parametrize("caps,dropped", [
    ("12.0,12.1", {"sgl_kernel/sm90/", "sgl_kernel/flash_ops"}),
    ("12.0", {"sgl_kernel/sm90/", "sgl_kernel/flash_ops"}),
    ("10.0", {"sgl_kernel/sm90/", "sgl_kernel/flash_ops"}),
    ("9.0", {"sgl_kernel/sm100/"}),
    ("8.9", {"sgl_kernel/sm90/"}),
    ("9.0,12.0", set()),
    ("sm90,sm120", set()),
])
def test_unusable_paths_follow_the_kernel_loader(caps, dropped):
    assert set(wh.unusable_paths("sglang-kernel", wh.parse_caps(caps))) == dropped
    assert wh.unusable_paths("torch", wh.parse_caps(caps)) == []


@pytest.mark.parametrize("text,caps", [
    ("12.0,12.1", [(12, 0), (12, 1)]), ("sm_120", [(12, 0)]), ("sm90", [(9, 0)]), (" 8.6 ", [(8, 6)]),
])
def test_parse_caps(text, caps):
    assert wh.parse_caps(text) == caps


@pytest.mark.parametrize("bad", ["", "twelve", "12", "sm_", "12.0.1"])
def test_parse_caps_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        wh.parse_caps(bad)


def test_slim_rewrites_the_wheel_and_its_record(tmp_path):
    wheel = make_wheel(tmp_path, KERNEL_FILES)
    wh.verify_record(wheel)
    size = wheel.stat().st_size
    saved, dropped = wh.slim_wheel(wheel, wh.unusable_paths("sglang-kernel", [(12, 0), (12, 1)]))
    assert sorted(dropped) == ["sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm90/common_ops.abi3.so"]
    assert saved > 0 and wheel.stat().st_size == size - saved
    wh.verify_record(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("sglang_kernel-0.4.5.dist-info/RECORD").decode()
        assert z.read("sgl_kernel/sm100/common_ops.abi3.so") == KERNEL_FILES["sgl_kernel/sm100/common_ops.abi3.so"]
    assert "sgl_kernel/flash_ops.abi3.so" not in names and "sgl_kernel/sm90/common_ops.abi3.so" not in names
    assert "flash_ops" not in record and "sm90/" not in record
    # Idempotent: nothing left to drop.
    assert wh.slim_wheel(wheel, ["sgl_kernel/flash_ops", "sgl_kernel/sm90/"]) == (0, [])

    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
         "--disable-pip-version-check", "--target", str(target), str(wheel)],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (target / "sgl_kernel" / "sm100" / "common_ops.abi3.so").exists()
    assert not (target / "sgl_kernel" / "flash_ops.abi3.so").exists()
    assert not (target / "sgl_kernel" / "sm90").exists()


def test_verify_record_catches_tampering(tmp_path):
    wheel = make_wheel(tmp_path, KERNEL_FILES)
    bad = tmp_path / "bad" / wheel.name
    bad.parent.mkdir()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, b"changed" if info.filename.endswith("version.py") else data)
    with pytest.raises(ValueError, match="does not match its RECORD hash"):
        wh.verify_record(bad)


def test_requirements_pin_every_wheel_by_hash(tmp_path):
    k = make_wheel(tmp_path, KERNEL_FILES)
    t = make_wheel(tmp_path, {"tiny_pkg/__init__.py": b""}, name="Tiny_Pkg", version="1.2.post3",
                   tag="py3-none-any")
    buf = io.StringIO()
    assert wh.write_requirements(tmp_path, buf) == 2
    text = buf.getvalue()
    assert f"sglang-kernel==0.4.5 \\\n    --hash=sha256:{hashlib.sha256(k.read_bytes()).hexdigest()}" in text
    assert f"tiny-pkg==1.2.post3 \\\n    --hash=sha256:{hashlib.sha256(t.read_bytes()).hexdigest()}" in text


def test_two_versions_of_one_package_are_refused(tmp_path):
    make_wheel(tmp_path, {"a/__init__.py": b""}, name="a", version="1.0", tag="py3-none-any")
    make_wheel(tmp_path, {"a/__init__.py": b""}, name="a", version="2.0", tag="py3-none-any")
    with pytest.raises(ValueError, match="two wheels for a"):
        wh.write_requirements(tmp_path, io.StringIO())


def test_series_digest_is_the_apply_tools():
    from patchkit.series import load_series  # scripts/ is an import root (pytest.ini)

    assert wh.series_digest(REPO) == load_series(REPO / "patches", REPO / "sglang").digest("copy")
