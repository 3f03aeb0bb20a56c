"""The worker process behind math grading and function tools (agentrl/worker_process.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO, process_gone


def test_a_busy_worker_exits_when_its_parent_is_killed(tmp_path):
    (tmp_path / "busy.py").write_text("def spin():\n    while True:\n        pass\n")
    parent = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        os.chdir({str(tmp_path)!r})
        from agentrl.worker_process import WorkerProcess
        worker = WorkerProcess("agentrl.tools.function_pool:handle")
        worker.wait_ready(60, "test")
        worker.send(("busy.py:spin", {{}}, True))  # busy for good
        print(worker.proc.pid, flush=True)
        os.kill(os.getpid(), 9)  # the parent dies without a word
    """)
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120)
    worker = int(out.stdout.split()[0])
    assert process_gone(worker, within_s=30), "the worker outlived its parent"


def test_a_worker_answers_with_its_handler_and_ends_when_its_pipe_closes(tmp_path, monkeypatch):
    from agentrl.worker_process import WorkerProcess

    monkeypatch.chdir(tmp_path)
    (tmp_path / "double.py").write_text("def double(x):\n    return 2 * x\n")
    worker = WorkerProcess("agentrl.tools.function_pool:handle")
    worker.wait_ready(60, "test")
    worker.send(("double.py:double", {"x": 21}, True))
    assert worker.receive() == ("ok", "42")
    worker.stop()
    assert worker.proc.returncode == 0
