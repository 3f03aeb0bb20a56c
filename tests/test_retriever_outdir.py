"""The output directory of `retriever build` (retriever/outdir.py): builds into one `--out` are exclusive
(a second build stops at once naming the first, a killed build's lock blocks nothing), and `--overwrite`
replaces only an index directory, never a folder of the user's files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from retriever.build import STATE_FILE, partial_dir
from retriever.docstore import DocStore
from retriever.errors import RetrieverError
from retriever.manifest import read_manifest
from tests.test_retriever_support import HAND_CORPUS, REPO, build_index, wait_for_file, write_jsonl


def _build_cmd(corpus: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "retriever", "build", "--corpus", str(corpus), "--out", str(out), "--index", "bm25",
            "--shard-size", "2", "--quiet", *extra]  # fmt: skip


def _start_blocked_build(tmp_path: Path, out: Path) -> tuple[subprocess.Popen, Path, object]:
    """A real build reading a pipe: fed four lines it commits two shards, then waits for more input. The
    test knows it holds the build (and its lock) once its state says two shards: no timing assumption."""
    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen(_build_cmd(fifo, out), cwd=REPO, stderr=subprocess.PIPE)
    writer = open(fifo, "wb")  # noqa: SIM115 - closed by the caller, which decides when the build may end
    writer.write(b"".join((json.dumps(r) + "\n").encode() for r in HAND_CORPUS[:4]))
    writer.flush()
    state_file = partial_dir(out) / STATE_FILE
    wait_for_file(state_file, lambda: json.loads(state_file.read_text())["shards"] == 2, proc)
    return proc, fifo, writer


def test_a_second_build_into_the_same_out_stops_at_once_naming_the_first(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    out = tmp_path / "idx"
    first, _, writer = _start_blocked_build(tmp_path, out)
    try:
        state_before = (partial_dir(out) / STATE_FILE).read_bytes()
        for extra in ((), ("--restart",), ("--overwrite",)):
            second = subprocess.run(_build_cmd(corpus, out, *extra), cwd=REPO, capture_output=True, text=True,
                                    timeout=120)  # fmt: skip
            assert second.returncode == 2, second.stderr
            assert second.stderr.startswith("error: ") and "Traceback" not in second.stderr
            assert f"another build of {out} is running (pid {first.pid}" in second.stderr
            # the loser touched nothing: the first build's partial directory is as it left it
            assert (partial_dir(out) / STATE_FILE).read_bytes() == state_before
            assert not out.exists()
        writer.write(b"".join((json.dumps(r) + "\n").encode() for r in HAND_CORPUS[4:]))
    finally:
        writer.close()  # end of the corpus: the first build finishes
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert read_manifest(out).corpus.rows == len(HAND_CORPUS)
    assert DocStore(out).get_many(list(range(len(HAND_CORPUS)))) == HAND_CORPUS


def test_a_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    out = tmp_path / "idx"
    first, _, writer = _start_blocked_build(tmp_path, out)
    first.send_signal(signal.SIGKILL)  # no clean-up runs: only the kernel releases its lock
    first.wait()
    writer.close()
    manifest = build_index(corpus, out, "bm25", shard_size=2)  # resumes the killed build's two shards
    assert manifest.corpus.rows == len(HAND_CORPUS)
    assert DocStore(out).get_many(list(range(len(HAND_CORPUS)))) == HAND_CORPUS


def test_overwrite_refuses_a_folder_of_user_files_and_deletes_nothing(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    corpus = write_jsonl(project / "corpus.jsonl", HAND_CORPUS)
    (project / "notes.txt").write_text("my notes\n")
    before = {p.name: p.read_bytes() for p in project.iterdir()}
    with pytest.raises(RetrieverError, match=rf"{project} is not an index directory.*(corpus\.jsonl|notes\.txt).*manifest\.json"):
        build_index(corpus, project, "bm25", overwrite=True)
    assert {p.name: p.read_bytes() for p in project.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["project"]


def test_overwrite_refuses_an_index_directory_holding_other_files(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    out = tmp_path / "idx"
    build_index(corpus, out, "bm25")
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(RetrieverError, match=r"notes\.txt"):
        build_index(corpus, out, "bm25", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine\n" and read_manifest(out).corpus.rows == len(HAND_CORPUS)


def test_overwrite_refuses_a_file(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    target = tmp_path / "out"
    target.write_text("not an index\n")
    with pytest.raises(RetrieverError, match=r"not a directory"):
        build_index(corpus, target, "bm25", overwrite=True)
    assert target.read_text() == "not an index\n"


def test_overwrite_replaces_an_index(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", HAND_CORPUS)
    out = tmp_path / "idx"
    build_index(corpus, out, "bm25")
    write_jsonl(corpus, HAND_CORPUS[:3])
    assert build_index(corpus, out, "bm25", overwrite=True).corpus.rows == 3
    assert read_manifest(out).corpus.rows == 3 and len(DocStore(out)) == 3
