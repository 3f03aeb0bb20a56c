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
