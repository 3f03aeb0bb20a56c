"""The `agentrl` entry point and import hygiene: --help stays light, the services never import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

HEAVY = ("torch", "transformers", "datasets", "ray", "math_verify", "sympy", "pydantic")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)


def test_cli_import_is_light():
    out = run_python(f"import sys, agentrl.cli; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_help_lists_only_working_groups():
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    for group in ("tasks", "sandbox", "retriever"):
        assert group in out.stdout
    for sub in ("validate", "show", "check"):
        sub_help = subprocess.run([sys.executable, "-m", "agentrl.cli", "tasks", sub, "--help"],
                                  capture_output=True, text=True, cwd=REPO)
        assert sub_help.returncode == 0 and "Usage" in sub_help.stdout


@pytest.mark.parametrize("package", ["sandbox", "retriever"])
def test_services_do_not_import_torch(package):
    out = run_python(f"import sys, {package}; print('torch' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_tasks_show_refuses_a_count_below_one():
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "tasks", "show", "tasks/torl_math.yaml", "-n", "0"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and "Invalid value for '-n'" in out.stderr


def test_tasks_check_refuses_an_out_that_is_a_file(tmp_path):
    taken = tmp_path / "summary.json"
    taken.write_text("{}")
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "tasks", "check", "tasks/torl_math.yaml", "--out", str(taken)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and "is a file; expected a directory" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "closed-port"}])
def test_tasks_show_without_a_reachable_hub_says_what_to_pass(tmp_path, env):
    """A tokenizer named by hub id, not cached, with the hub off or unreachable: one line naming the
    option to pass, from the reachability check (not the hub client's retries and their message)."""
    import os
    import socket

    if env.get("HF_ENDPOINT") == "closed-port":
        with socket.socket() as s:  # a loopback port nothing listens on: connections are refused
            s.bind(("127.0.0.1", 0))
            env = {"HF_ENDPOINT": f"http://127.0.0.1:{s.getsockname()[1]}"}
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    run_env.update(HF_HOME=str(tmp_path / "hf"), **env)
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "tasks", "show", "tasks/torl_math.yaml",
                          "--tokenizer", "agentrl-tests/no-such-tokenizer"],
                         capture_output=True, text=True, cwd=REPO, env=run_env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "'agentrl-tests/no-such-tokenizer' is neither a local directory nor in the Hugging Face cache" in lines[0]
    assert lines[0].endswith("pass a local tokenizer directory as --tokenizer")
    assert ("HF_HUB_OFFLINE is set" if "HF_HUB_OFFLINE" in env else "cannot be reached") in lines[0]
