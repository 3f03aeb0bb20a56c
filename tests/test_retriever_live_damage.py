"""A docs store cut short under a running `retriever serve` (docstore.py): the requests that read a row past
the new end are answered 500 naming the file, the server stays up, and rows still intact keep being served;
restoring the file in place heals it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from tests.test_retriever_support import HAND_CORPUS, REPO, build_index, free_port, wait_healthy, write_jsonl

# Enough rows that the store and its offsets span several pages: a read of a mapped page wholly past the end
# of a file is what raises SIGBUS (within the last page the kernel reads zeros).
FILLER = [{"id": f"f{i}", "contents": f'"Filler {i}"\nfiller words number {i} padding'} for i in range(700)]
LAST = {"id": "zebra", "contents": '"Zebra"\nThe zebra is an African equine with black and white stripes.'}


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("live")
    build_index(write_jsonl(root / "c.jsonl", [HAND_CORPUS[0], *FILLER, LAST]), root / "idx", "bm25")
    return root / "idx"


def _ask(url: str, query: str) -> httpx.Response:
    return httpx.post(f"{url}/retrieve", json={"queries": [query], "topk": 1}, timeout=30)


@pytest.mark.parametrize("name, keep", [("docs.jsonl", "first row"), ("docs.offsets.bin", 16)])
def test_a_store_cut_short_under_the_server_answers_errors_and_keeps_serving(index_dir, tmp_path, name, keep):
    copy = shutil.copytree(index_dir, tmp_path / "idx")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "retriever", "serve", "--index", str(copy), "--port", str(port)],
                            cwd=REPO, stderr=subprocess.PIPE)  # fmt: skip
    try:
        wait_healthy(url, proc=proc)
        assert _ask(url, "zebra stripes").json()["result"][0][0]["id"] == "zebra"  # read (and mapped) while whole
        path = copy / name
        original = path.read_bytes()
        cut = len(original.split(b"\n", 1)[0]) + 1 if keep == "first row" else keep
        os.truncate(path, cut)  # the first row stays whole, the last one is gone
        response = _ask(url, "zebra stripes")
        assert proc.poll() is None, f"the server died (exit {proc.returncode}) reading a cut-short {name}"
        assert response.status_code >= 500
        assert name in response.json()["detail"] and "rebuild or restore" in response.json()["detail"]
        intact = _ask(url, "hamlet shakespeare")
        assert intact.status_code == 200 and intact.json()["result"][0] == [HAND_CORPUS[0]]
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        with open(path, "r+b") as f:  # an in-place restore: the same file, whole again
            f.write(original)
        assert _ask(url, "zebra stripes").json()["result"][0] == [LAST]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
