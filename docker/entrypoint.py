# SPDX-License-Identifier: Apache-2.0
"""Entrypoint of the ddtree-sglang:sm120 image.

``docker run --gpus all IMAGE --model-path M --speculative-draft-model-path D`` starts
SGLang's OpenAI-compatible server on 0.0.0.0:30000 with DDTree speculative decoding.
Every upstream flag passes through unchanged; the common ones can also come from
environment variables (handy in compose files), and a flag on the command line always
wins over its variable. The first argument may instead name a command: ``doctor``,
``help``, ``healthcheck``, or any program in the image (``bash``, ``python``).
Before the server starts, what would fail later with a long traceback is said in one
line: no GPU visible, an absolute model path that is not mounted in the container;
and a /dev/shm too small for SGLang is warned about.

Kept free of heavy imports: it runs on every container start and every health check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import urllib.error
import urllib.request
from typing import Callable, Mapping, Optional, Sequence

PYTHON = sys.executable
SERVER_MODULE = "sglang.launch_server"
DOCTOR_MODULE = "sglang.cli.ddtree_doctor"
DEFAULT_HOST = "0.0.0.0"
DEFAULT_PORT = 30000
DEFAULT_ALGORITHM = "DDTREE"
# Where the entrypoint records the port it served on, for the health check.
PORT_FILE = os.environ.get("DDTREE_PORT_FILE", "/tmp/ddtree-server-port")

EXIT_USAGE = 2
EXIT_NO_GPU = 3


class UsageError(ValueError):
    """Bad arguments or environment: reported in one line, exit status 2."""


def _positive_int(name: str, value: str) -> str:
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{name}={value!r} is not a positive integer")
    return str(int(value))


def _port(name: str, value: str) -> str:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise UsageError(f"{name}={value!r} is not a TCP port (1-65535)")
    return str(int(value))


def _fraction(name: str, value: str) -> str:
    try:
        f = float(value)
    except ValueError:
        f = -1.0
    if not 0.0 < f < 1.0:
        raise UsageError(f"{name}={value!r} must be a fraction between 0 and 1, e.g. 0.85")
    return value


def _text(name: str, value: str) -> str:
    return value


#: ``--speculative-ddtree-budget-policy``'s values (speculative/ddtree/flags.py BUDGET_POLICIES;
#: the entrypoint checks them before sglang is imported).
BUDGET_POLICIES = ("fixed", "adaptive", "auto")


def _budget_policy(name: str, value: str) -> str:
    if value not in BUDGET_POLICIES:
        raise UsageError(f"{name}={value!r} is not a DDTREE budget policy ({', '.join(BUDGET_POLICIES)})")
    return value


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bool(name: str, value: str) -> Optional[bool]:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise UsageError(f"{name}={value!r} is not a boolean (use 1/0, true/false)")


@dataclasses.dataclass(frozen=True)
class EnvFlag:
    env: str
    flags: tuple  # upstream option strings; the first is the one we emit
    check: Callable[[str, str], str] = _text
    switch: bool = False  # a store_true flag: the variable says whether to pass it
    help: str = ""


# The variables we read and the upstream flag each one stands for. The aliases must be
# exactly upstream's option strings (tests/cpu/docker checks them against its parser).
ENV_FLAGS = (
    EnvFlag("MODEL_PATH", ("--model-path", "--model"), help="target model (HF id or path)"),
    EnvFlag("DRAFT_MODEL_PATH", ("--speculative-draft-model-path", "--speculative-draft-model"),
            help="DFlash drafter; turns DDTree on"),
    EnvFlag("SPECULATIVE_ALGORITHM", ("--speculative-algorithm",),
            help="default DDTREE when a drafter is given"),
    EnvFlag("DDTREE_BUDGET", ("--speculative-ddtree-budget",), _positive_int,
            help="tree budget (draft nodes per verify)"),
    EnvFlag("DDTREE_BUDGET_POLICY", ("--speculative-ddtree-budget-policy",), _budget_policy,
            help="fixed, adaptive or auto (the default: B=64 adaptive with verify graphs at 16 where it can)"),
    EnvFlag("TP_SIZE", ("--tp-size", "--tensor-parallel-size"), _positive_int,
            help="tensor parallelism (GPUs)"),
    EnvFlag("DP_SIZE", ("--dp-size", "--data-parallel-size"), _positive_int,
            help="data parallelism"),
    EnvFlag("MEM_FRACTION_STATIC", ("--mem-fraction-static",), _fraction,
            help="GPU memory share for weights + KV cache"),
    EnvFlag("CONTEXT_LENGTH", ("--context-length",), _positive_int, help="max context tokens"),
    EnvFlag("MAX_RUNNING_REQUESTS", ("--max-running-requests",), _positive_int),
    EnvFlag("CHUNKED_PREFILL_SIZE", ("--chunked-prefill-size",)),
    EnvFlag("ATTENTION_BACKEND", ("--attention-backend",)),
    EnvFlag("KV_CACHE_DTYPE", ("--kv-cache-dtype",)),
    EnvFlag("QUANTIZATION", ("--quantization",)),
    EnvFlag("SERVED_MODEL_NAME", ("--served-model-name",)),
    EnvFlag("API_KEY", ("--api-key",)),
    EnvFlag("LOG_LEVEL", ("--log-level",)),
    EnvFlag("TRUST_REMOTE_CODE", ("--trust-remote-code",), switch=True),
    EnvFlag("HOST", ("--host",), help=f"default {DEFAULT_HOST}"),
    EnvFlag("PORT", ("--port",), _port, help=f"default {DEFAULT_PORT}"),
)
EXTRA_ARGS_ENV = "DDTREE_EXTRA_ARGS"  # more upstream flags, shell-quoted
SKIP_GPU_CHECK_ENV = "DDTREE_SKIP_GPU_CHECK"
SECRET_FLAGS = ("--api-key", "--admin-api-key")


def _given(argv: Sequence[str], flags: Sequence[str]) -> Optional[str]:
    """The value of the first of `flags` on `argv`, "" for a bare switch; None if absent."""
    for i, arg in enumerate(argv):
        for flag in flags:
            if arg == flag:
                nxt = argv[i + 1] if i + 1 < len(argv) else ""
                return "" if nxt.startswith("-") else nxt
            if arg.startswith(flag + "="):
                return arg[len(flag) + 1:]
    return None


def server_args(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """Upstream server flags for `argv` (ours, after the image name) and `environ`.

    Flags derived from the environment come first and the user's own argv last, so for
    anything set both ways the command line wins, as argparse keeps the last value.
    """
    extra = shlex.split(environ.get(EXTRA_ARGS_ENV, ""))
    user = [*extra, *argv]
    out: list[str] = []
    for ef in ENV_FLAGS:
        raw = environ.get(ef.env, "")
        if raw == "" or _given(user, ef.flags) is not None:
            continue
        if ef.switch:
            if _bool(ef.env, raw):
                out.append(ef.flags[0])
        else:
            out += [ef.flags[0], ef.check(ef.env, raw)]
    defaults = {"--host": DEFAULT_HOST, "--port": str(DEFAULT_PORT)}
    for flag, value in defaults.items():
        if _given(user, (flag,)) is None and _given(out, (flag,)) is None:
            out += [flag, value]
    everything = [*out, *user]
    draft = _given(everything, ENV_FLAGS[1].flags)
    if draft and _given(everything, ("--speculative-algorithm",)) is None:
        out += ["--speculative-algorithm", DEFAULT_ALGORITHM]
    if _given(everything, ENV_FLAGS[0].flags) in (None, "") and _given(everything, ("--config",)) is None:
        raise UsageError(
            "no model given: pass --model-path MODEL (or set MODEL_PATH); "
            "see 'docker run IMAGE --help'"
        )
    return [*out, *user]


def server_command(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    # `python -m sglang.launch_server` warns that `sglang serve` is preferred; same server.
    return [PYTHON, "-W", "ignore::UserWarning:__main__", "-m", SERVER_MODULE,
            *server_args(argv, environ)]


def redacted(args: Sequence[str]) -> list[str]:
    """`args` with secrets masked, for the log line."""
    out = list(args)
    for i, arg in enumerate(out):
        for flag in SECRET_FLAGS:
            if arg == flag and i + 1 < len(out):
                out[i + 1] = "***"
            elif arg.startswith(flag + "="):
                out[i] = flag + "=***"
    return out


def _served_port(args: Sequence[str]) -> int:
    value = _given(args, ("--port",))
    return int(value) if value and value.isdigit() else DEFAULT_PORT


# --------------------------------------------------------------------------- GPU check


def visible_gpus() -> list[tuple[str, tuple[int, int]]]:
    """(name, capability) of each CUDA device this container can use; [] without one."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [
        (torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
        for i in range(torch.cuda.device_count())
    ]


def build_info(path: str = os.environ.get("DDTREE_BUILD_INFO", "/opt/ddtree/build.json")) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def gpu_problem(args: Sequence[str], environ: Mapping[str, str], gpus, info: dict) -> Optional[str]:
    """Why the server cannot start on these GPUs, or None when it can."""
    device = _given(args, ("--device",))
    if device not in (None, "cuda") or environ.get(SKIP_GPU_CHECK_ENV, "") in _TRUE:
        return None
    if not gpus:
        return (
            "no NVIDIA GPU is visible in this container, so the server cannot start.\n"
            "  - start it with the NVIDIA Container Toolkit: docker run --gpus all ...\n"
            "  - check that the host driver is 580 or newer (CUDA 13): nvidia-smi\n"
            "  - 'docker run --gpus all IMAGE doctor' reports what the container sees"
        )
    dropped = info.get("dropped", [])
    for name, cap in gpus:
        if cap == (9, 0) and any(d.startswith("sgl_kernel/sm90") for d in dropped):
            return (
                f"{name} (compute capability 9.0) needs sgl_kernel's sm90 kernels, which this "
                f"image leaves out (built for {info.get('gpu_arch', '?')}); rebuild with "
                "--build-arg GPU_ARCH=9.0,12.0,12.1"
            )
    return None


# --------------------------------------------------------------------------- paths, /dev/shm

MODEL_FLAGS = (
    (ENV_FLAGS[0].flags, None),
    (("--tokenizer-path",), "the tokenizer"),
    (ENV_FLAGS[1].flags, "drafter"),
)


def _drafter_role(args: Sequence[str]) -> str:
    algorithm = (_given(args, ("--speculative-algorithm",)) or "").upper()
    if algorithm == "DDTREE":
        return "the DFlash drafter DDTREE drafts with"
    if algorithm in ("DFLASH", "DSPARK"):
        return f"the {algorithm} drafter"
    return "the draft model"


def path_problem(args: Sequence[str], exists: Callable[[str], bool] = os.path.exists) -> Optional[str]:
    """Why a model path on the command line cannot be served from this container: an
    absolute path that is not there, which means the host directory was not mounted
    (a Hugging Face id is looked up, or downloaded, by the server itself)."""
    for flags, role in MODEL_FLAGS:
        path = _given(args, flags)
        if not path or not os.path.isabs(path) or exists(path):
            continue
        if role == "drafter":
            role = _drafter_role(args)
        what = f" ({role})" if role else ""
        return (
            f"{flags[0]} {path}{what} does not exist inside the container: mount the host "
            f"directory that holds it, e.g. docker run -v /path/on/host:{path}:ro ... "
            f"(or pass a Hugging Face id and mount -v ~/.cache/huggingface:/root/.cache/huggingface)"
        )
    return None


SHM_PATH = "/dev/shm"
SHM_MIN_BYTES = 1 << 30


def shm_warning(statvfs: Optional[Callable[[str], os.statvfs_result]] = None) -> Optional[str]:
    """A warning when /dev/shm is too small for SGLang's processes (Docker gives 64 MB
    unless told otherwise); None when it is large enough or cannot be read."""
    try:
        st = (statvfs or os.statvfs)(SHM_PATH)
    except OSError:
        return None
    size = st.f_frsize * st.f_blocks
    if size >= SHM_MIN_BYTES:
        return None
    return (
        f"{SHM_PATH} is {size / 2**20:.0f} MB: SGLang's processes exchange tensors through "
        "shared memory and can fail or hang with this little; start the container with "
        "--ipc=host (or --shm-size 16g)"
    )


# --------------------------------------------------------------------------- commands

HELP = f"""\
ddtree-sglang: SGLang {{upstream}} with DDTree speculative decoding, built for Blackwell
workstation GPUs (compute capability {{gpu_arch}}). Series {{series}}.

usage: docker run --gpus all --ipc=host -p 30000:30000 IMAGE [SGLANG FLAGS...]
       docker run --gpus all IMAGE doctor [--json]   what the container sees, and verdicts
       docker run IMAGE help | --help                this text, then upstream's flags
       docker run -it IMAGE bash | python ...        any other program in the image

The server listens on {DEFAULT_HOST}:{DEFAULT_PORT} (OpenAI-compatible /v1/..., /health,
/metrics). With a draft model (--speculative-draft-model-path, a DFlash drafter) it runs
--speculative-algorithm {DEFAULT_ALGORITHM} unless you choose another algorithm.

Environment variables (a flag given on the command line wins):
{{envs}}
  {EXTRA_ARGS_ENV:<22} more upstream flags, shell-quoted
  {SKIP_GPU_CHECK_ENV:<22} 1 = start even when no GPU is visible

Caches: HF_HOME=/root/.cache/huggingface and the JIT caches under /cache: mount volumes
there to keep downloads and compiled kernels across containers (docs/docker.md).

Upstream SGLang's flags follow; every one of them is accepted.
"""


def print_help(environ: Mapping[str, str]) -> int:
    info = build_info()
    envs = "\n".join(
        f"  {ef.env:<22} {ef.flags[0]:<32} {ef.help}".rstrip() for ef in ENV_FLAGS
    )
    print(HELP.format(upstream=info.get("upstream_version", "?"),
                      gpu_arch=info.get("gpu_arch", "?"),
                      series=str(info.get("series_digest", "?"))[:12], envs=envs))
    sys.stdout.flush()
    import subprocess

    return subprocess.call([PYTHON, "-W", "ignore::UserWarning", "-m", SERVER_MODULE, "--help"])


def healthcheck(environ: Mapping[str, str]) -> int:
    port = environ.get("PORT") or DEFAULT_PORT
    try:
        with open(PORT_FILE) as f:
            port = int(f.read().strip())
    except (OSError, ValueError):
        pass
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=8) as r:
            return 0 if r.status == 200 else 1
    except (urllib.error.URLError, OSError):
        return 1


def main(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if environ is None else environ
    cmd = argv[0] if argv else ""
    try:
        if cmd in ("help", "--help", "-h"):
            return print_help(environ)
        if cmd == "doctor":
            os.execv(PYTHON, [PYTHON, "-W", "ignore::UserWarning", "-m", DOCTOR_MODULE, *argv[1:]])
        if cmd == "healthcheck":
            return healthcheck(environ)
        if cmd and not cmd.startswith("-") and cmd != "serve":
            try:
                os.execvp(cmd, argv)
            except FileNotFoundError:
                raise UsageError(f"unknown command '{cmd}': server flags start with '--' "
                                 "(see 'docker run IMAGE --help')") from None
        if cmd == "serve":
            argv = argv[1:]
        command = server_command(argv, environ)
        problem = gpu_problem(command, environ, visible_gpus(), build_info())
        if problem:
            print(f"ddtree-sglang: error: {problem}", file=sys.stderr)
            return EXIT_NO_GPU
        problem = path_problem(command)
        if problem:
            raise UsageError(problem)
    except UsageError as e:
        print(f"ddtree-sglang: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    warning = shm_warning()
    if warning:
        print(f"ddtree-sglang: warning: {warning}", file=sys.stderr)
    try:
        with open(PORT_FILE, "w") as f:
            f.write(f"{_served_port(command)}\n")
    except OSError:
        pass
    print("ddtree-sglang: " + shlex.join(["python", *redacted(command[3:])]), file=sys.stderr, flush=True)
    os.execv(PYTHON, command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
