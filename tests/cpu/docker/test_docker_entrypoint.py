# SPDX-License-Identifier: Apache-2.0
"""The image entrypoint: env/flag translation, DDTree default, GPU refusal, health check.

The flag tables are checked against upstream's real argument parser (patched, as `make test`
applies the series), and the commands the entrypoint builds are parsed by that parser.
"""

import argparse
import http.server
import importlib.util
import pathlib
import sys
import threading

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


ep = _load("ddtree_entrypoint", REPO / "docker" / "entrypoint.py")


@pytest.fixture(scope="module")
def upstream_parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_plain_flags_get_host_port_and_ddtree_default():
    args = ep.server_args(["--model-path", "M", "--speculative-draft-model-path", "D"], {})
    assert args[:4] == ["--host", "0.0.0.0", "--port", "30000"]
    assert args[args.index("--speculative-algorithm") + 1] == "DDTREE"
    assert args[-4:] == ["--model-path", "M", "--speculative-draft-model-path", "D"]


def test_no_draft_model_means_no_speculation():
    args = ep.server_args(["--model-path", "M"], {})
    assert "--speculative-algorithm" not in args


@pytest.mark.parametrize("argv,env", [
    (["--model", "M", "--speculative-draft-model", "D", "--speculative-algorithm", "DFLASH"], {}),
    (["--model-path=M", "--speculative-draft-model-path=D", "--speculative-algorithm=DFLASH"], {}),
    (["--model-path", "M"], {"DRAFT_MODEL_PATH": "D", "SPECULATIVE_ALGORITHM": "DFLASH"}),
])
def test_users_algorithm_choice_is_kept(argv, env):
    args = ep.server_args(argv, env)
    assert args.count("--speculative-algorithm") + sum(a.startswith("--speculative-algorithm=") for a in args) == 1
    assert "DDTREE" not in args


def test_environment_becomes_flags():
    env = {"MODEL_PATH": "M", "DRAFT_MODEL_PATH": "D", "TP_SIZE": "2", "MEM_FRACTION_STATIC": "0.8",
           "CONTEXT_LENGTH": "32768", "PORT": "8000", "TRUST_REMOTE_CODE": "yes", "DDTREE_BUDGET": "32",
           "DDTREE_BUDGET_POLICY": "auto", "DDTREE_EXTRA_ARGS": "--log-level debug --served-model-name 'my model'"}
    args = ep.server_args([], env)
    pairs = dict(zip(args, args[1:]))
    assert pairs["--model-path"] == "M" and pairs["--speculative-draft-model-path"] == "D"
    assert pairs["--tp-size"] == "2" and pairs["--mem-fraction-static"] == "0.8"
    assert pairs["--context-length"] == "32768" and pairs["--port"] == "8000"
    assert pairs["--speculative-ddtree-budget"] == "32" and pairs["--speculative-ddtree-budget-policy"] == "auto"
    assert pairs["--speculative-algorithm"] == "DDTREE"
    assert pairs["--served-model-name"] == "my model"
    assert "--trust-remote-code" in args and "30000" not in args


def test_command_line_wins_over_environment():
    env = {"MODEL_PATH": "env-model", "TP_SIZE": "8", "PORT": "9000", "TRUST_REMOTE_CODE": "0"}
    args = ep.server_args(["--model", "cli-model", "--tensor-parallel-size=2", "--port", "1234"], env)
    assert "env-model" not in args and "8" not in args and "9000" not in args
    assert "--trust-remote-code" not in args
    assert args.count("--port") == 1


@pytest.mark.parametrize("env,message", [
    ({"MODEL_PATH": "M", "TP_SIZE": "two"}, "TP_SIZE='two' is not a positive integer"),
    ({"MODEL_PATH": "M", "TP_SIZE": "0"}, "TP_SIZE='0' is not a positive integer"),
    ({"MODEL_PATH": "M", "MEM_FRACTION_STATIC": "85"}, "MEM_FRACTION_STATIC='85' must be a fraction"),
    ({"MODEL_PATH": "M", "PORT": "70000"}, "PORT='70000' is not a TCP port"),
    ({"MODEL_PATH": "M", "TRUST_REMOTE_CODE": "maybe"}, "TRUST_REMOTE_CODE='maybe' is not a boolean"),
    ({}, "no model given"),
    ({"MODEL_PATH": ""}, "no model given"),
])
def test_bad_input_is_a_usage_error(env, message):
    with pytest.raises(ep.UsageError, match=message):
        ep.server_args([], env)


def test_config_file_may_carry_the_model():
    assert ep.server_args(["--config", "serve.yaml"], {})[-2:] == ["--config", "serve.yaml"]


def test_env_flags_are_upstream_option_strings(upstream_parser):
    """Every flag we emit or look for is one of upstream's spellings of one option."""
    actions = upstream_parser._option_string_actions
    for ef in ep.ENV_FLAGS:
        dests = {actions[f].dest for f in ef.flags if f in actions}
        missing = [f for f in ef.flags if f not in actions]
        assert not missing, f"{ef.env}: upstream has no {missing}"
        assert len(dests) == 1, f"{ef.env}: {ef.flags} name different options {dests}"
        if ef.switch:
            assert actions[ef.flags[0]].nargs == 0, f"{ef.env}: {ef.flags[0]} takes a value upstream"


def test_every_alias_of_mapped_options_is_known(upstream_parser):
    """If upstream spells an option another way, the CLI-wins rule must see that spelling too."""
    actions = upstream_parser._option_string_actions
    for ef in ep.ENV_FLAGS:
        upstream_spellings = set(actions[ef.flags[0]].option_strings)
        assert upstream_spellings == set(ef.flags), f"{ef.env}: upstream spells it {upstream_spellings}"


def test_upstream_parser_accepts_what_we_build(upstream_parser):
    env = {"MODEL_PATH": "M", "DRAFT_MODEL_PATH": "D", "TP_SIZE": "2", "MEM_FRACTION_STATIC": "0.85",
           "CONTEXT_LENGTH": "65536", "TRUST_REMOTE_CODE": "1", "DDTREE_BUDGET": "48", "PORT": "31000"}
    ns = upstream_parser.parse_args(ep.server_args(["--max-running-requests", "8"], env))
    assert (ns.model_path, ns.speculative_draft_model_path, ns.tp_size) == ("M", "D", 2)
    assert (ns.host, ns.port, ns.context_length) == ("0.0.0.0", 31000, 65536)
    assert ns.speculative_algorithm == "DDTREE" and ns.speculative_ddtree_budget == 48
    assert ns.trust_remote_code and ns.max_running_requests == 8 and ns.mem_fraction_static == 0.85


def test_server_command_runs_upstreams_launcher():
    cmd = ep.server_command(["--model-path", "M"], {})
    assert cmd[0] == ep.PYTHON and cmd[cmd.index("-m") + 1] == "sglang.launch_server"


def test_gpu_gate():
    cmd = ep.server_args(["--model-path", "M"], {})
    assert "no NVIDIA GPU is visible" in ep.gpu_problem(cmd, {}, [], {})
    assert ep.gpu_problem(cmd + ["--device", "cpu"], {}, [], {}) is None
    assert ep.gpu_problem(cmd, {"DDTREE_SKIP_GPU_CHECK": "1"}, [], {}) is None
    slim = {"gpu_arch": "12.0,12.1", "dropped": ["sgl_kernel/sm90/", "sgl_kernel/flash_ops"]}
    assert ep.gpu_problem(cmd, {}, [("NVIDIA RTX PRO 6000 Blackwell", (12, 0))], slim) is None
    assert ep.gpu_problem(cmd, {}, [("NVIDIA GB10", (12, 1))], slim) is None
    msg = ep.gpu_problem(cmd, {}, [("NVIDIA H200", (9, 0))], slim)
    assert "sm90" in msg and "GPU_ARCH=" in msg


def test_main_refuses_without_gpu_on_this_machine(capsys, tmp_path):
    """This CPU machine really has no GPU: the server must not start, and say why."""
    rc = ep.main(["--model-path", str(tmp_path), "--speculative-draft-model-path", str(tmp_path)], {})
    err = capsys.readouterr().err
    assert rc == ep.EXIT_NO_GPU
    assert "no NVIDIA GPU is visible" in err and "--gpus all" in err and "Traceback" not in err


def test_main_usage_errors(capsys):
    assert ep.main([], {}) == ep.EXIT_USAGE
    assert "no model given" in capsys.readouterr().err
    assert ep.main(["no-such-program-xyz"], {}) == ep.EXIT_USAGE
    assert "unknown command 'no-such-program-xyz'" in capsys.readouterr().err


def test_api_key_is_not_logged():
    assert ep.redacted(["--api-key", "s3cret", "--port", "1"]) == ["--api-key", "***", "--port", "1"]
    assert ep.redacted(["--api-key=s3cret"]) == ["--api-key=***"]


@pytest.fixture()
def health_server():
    statuses = {"/health": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(statuses.get(self.path, 404))
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], statuses
    srv.shutdown()


def test_healthcheck(health_server, tmp_path, monkeypatch):
    port, statuses = health_server
    port_file = tmp_path / "port"
    monkeypatch.setattr(ep, "PORT_FILE", str(port_file))
    port_file.write_text(f"{port}\n")
    assert ep.healthcheck({}) == 0
    statuses["/health"] = 503
    assert ep.healthcheck({}) == 1
    port_file.unlink()
    statuses["/health"] = 200
    assert ep.healthcheck({"PORT": str(port)}) == 0


# --------------------------------------------------------------------------- model paths, /dev/shm


@pytest.mark.parametrize("argv,env,flag,role", [
    (["--model-path", "/models/Qwen3-8B"], {}, "--model-path", ""),
    (["--model=/models/Qwen3-8B"], {}, "--model-path", ""),
    ([], {"MODEL_PATH": "/models/Qwen3-8B"}, "--model-path", ""),
    (["--model-path", "Qwen/Qwen3-8B", "--speculative-draft-model-path", "/models/Qwen3-8B"], {},
     "--speculative-draft-model-path", " (the DFlash drafter DDTREE drafts with)"),
    (["--model-path", "Qwen/Qwen3-8B", "--speculative-draft-model-path", "/models/Qwen3-8B",
      "--speculative-algorithm", "DFLASH"], {}, "--speculative-draft-model-path", " (the DFLASH drafter)"),
    (["--model-path", "Qwen/Qwen3-8B", "--tokenizer-path", "/models/Qwen3-8B"], {}, "--tokenizer-path",
     " (the tokenizer)"),
])  # fmt: skip
def test_unmounted_model_path_is_one_line(argv, env, flag, role):
    msg = ep.path_problem(ep.server_args(argv, env), exists=lambda p: False)
    assert msg.startswith(f"{flag} /models/Qwen3-8B{role} does not exist inside the container")
    assert "-v /path/on/host:/models/Qwen3-8B:ro" in msg and "\n" not in msg


def test_mounted_paths_and_hub_ids_pass(tmp_path):
    mounted = str(tmp_path)
    assert ep.path_problem(ep.server_args(["--model-path", mounted, "--speculative-draft-model-path", mounted], {})) is None
    assert ep.path_problem(ep.server_args(["--model-path", "Qwen/Qwen3-8B",
                                           "--speculative-draft-model-path", "z-lab/Qwen3-8B-DFlash-b16"], {})) is None


def test_path_flags_are_upstream_option_strings(upstream_parser):
    actions = upstream_parser._option_string_actions
    for flags, _ in ep.MODEL_FLAGS:
        assert set(actions[flags[0]].option_strings) == set(flags), flags


def test_main_refuses_an_unmounted_model_in_one_line(capsys, monkeypatch, tmp_path):
    """With a GPU (faked: this machine has none), an unmounted path is a usage error
    that names the path and the mount, and the server is not started."""
    monkeypatch.setattr(ep, "visible_gpus", lambda: [("NVIDIA RTX PRO 6000 Blackwell", (12, 0))])
    monkeypatch.setattr(ep, "PORT_FILE", str(tmp_path / "port"))
    monkeypatch.setattr(ep.os, "execv", lambda *a: pytest.fail(f"the server was started: {a}"))
    rc = ep.main(["--model-path", str(tmp_path), "--speculative-draft-model-path", "/models/no-such-drafter"], {})
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == ep.EXIT_USAGE
    assert err == ["ddtree-sglang: error: --speculative-draft-model-path /models/no-such-drafter (the DFlash "
                   "drafter DDTREE drafts with) does not exist inside the container: mount the host directory "
                   "that holds it, e.g. docker run -v /path/on/host:/models/no-such-drafter:ro ... (or pass a "
                   "Hugging Face id and mount -v ~/.cache/huggingface:/root/.cache/huggingface)"]


def _statvfs(size_bytes):
    import os

    def statvfs(path):
        assert path == "/dev/shm"
        return os.statvfs_result((4096, 4096, size_bytes // 4096, 0, 0, 0, 0, 0, 0, 255))

    return statvfs


def test_small_dev_shm_is_warned_about():
    msg = ep.shm_warning(_statvfs(64 << 20))  # Docker's default
    assert msg.startswith("/dev/shm is 64 MB") and "--ipc=host" in msg and "--shm-size" in msg
    assert ep.shm_warning(_statvfs(16 << 30)) is None
    assert ep.shm_warning(lambda path: (_ for _ in ()).throw(OSError("no /dev/shm"))) is None


def test_main_warns_about_dev_shm_and_still_serves(capsys, monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr(ep, "visible_gpus", lambda: [("NVIDIA RTX PRO 6000 Blackwell", (12, 0))])
    monkeypatch.setattr(ep, "PORT_FILE", str(tmp_path / "port"))
    monkeypatch.setattr(ep.os, "statvfs", _statvfs(64 << 20))
    monkeypatch.setattr(ep.os, "execv", lambda prog, argv: started.append(argv))
    ep.main(["--model-path", str(tmp_path)], {})
    err = capsys.readouterr().err
    assert "ddtree-sglang: warning: /dev/shm is 64 MB" in err
    assert started and started[0][started[0].index("-m") + 1] == "sglang.launch_server"


def test_budget_policy_values_are_the_servers():
    """The entrypoint checks DDTREE_BUDGET_POLICY before sglang is imported, against the
    values the server accepts."""
    from sglang.srt.speculative.ddtree.flags import BUDGET_POLICIES

    assert ep.BUDGET_POLICIES == BUDGET_POLICIES
    with pytest.raises(ep.UsageError, match="DDTREE_BUDGET_POLICY='dynamic' is not a DDTREE budget policy"):
        ep.server_args(["--model-path", "M"], {"DDTREE_BUDGET_POLICY": "dynamic"})
