"""The output directory of a build (build.py, reindex.py): the lock that makes builds into one `--out`
exclusive, and the rule for what `--overwrite` may replace.

The lock is `fcntl.flock` on `.OUT.lock` beside OUT, held for the whole build. It lives beside OUT, not in
it nor in `OUT.partial/`, because `--restart` deletes the partial directory, the publish renames it to OUT
and `--overwrite` deletes the old OUT: none of them may remove the file a running build holds locked, or a
second build would lock a new file of the same name while the first still runs. The file stays after the
build for the same reason (deleting it would let two builds hold locks on two different files). The
kernel drops a flock when its holder dies, so a killed build's lock blocks nothing; the file holds the
holder's pid and start time only to name it to a build that is refused.

`--overwrite` replaces only an index directory: one holding `manifest.json` and nothing but what a build
writes (INDEX_ENTRIES). Anything else (a project folder, the corpus, the user's notes) is refused, named,
and left as it is.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from retriever.bm25 import BM25_DIR
from retriever.docstore import DOCS_FILE, OFFSETS_FILE
from retriever.errors import RetrieverError
from retriever.ingest import EMBEDDINGS_DIR
from retriever.manifest import MANIFEST_FILE

FAISS_FILE = "index.faiss"  # faiss_index.INDEX_FILE (that module imports faiss, which this one must not)
# Everything a build leaves in a finished index directory: --overwrite deletes a directory holding only these.
INDEX_ENTRIES = frozenset({MANIFEST_FILE, DOCS_FILE, OFFSETS_FILE, FAISS_FILE, BM25_DIR, EMBEDDINGS_DIR})


def lock_path(out: Path) -> Path:
    """The lock file of builds into `out`: beside it (see the module docstring for why not inside)."""
    return out.with_name(f".{out.name}.lock")


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold the lock of builds into `out` for the `with` block, or raise RetrieverError naming the build that
    holds it. Never waits: a second build of the same command would only redo the first's work."""
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "pid not yet recorded"
            raise RetrieverError(
                f"another build of {out} is running ({holder}; lock {path}); wait for it to finish or stop it, "
                "then run this command again (a resumed build continues where it stopped)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, started {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # a finished build names no holder; a killed one leaves its pid, and no lock
    finally:
        os.close(fd)  # releases the flock (the kernel does the same for a killed process)


def check_replaceable(out: Path, corpus: Path | None = None) -> None:
    """Raise RetrieverError unless `out` may be deleted by --overwrite: an index directory (a manifest and
    only the files a build writes), or an empty directory, that does not hold the corpus being read."""
    expected = (f"--overwrite replaces only an index directory (its {MANIFEST_FILE} and the files a build writes: "
                f"{', '.join(sorted(INDEX_ENTRIES - {MANIFEST_FILE}))}); choose another --out, or move the other "
                "files away")  # fmt: skip
    if out.is_symlink() or not out.is_dir():
        raise RetrieverError(f"{out} is not a directory; {expected}; nothing was deleted")
    names = sorted(p.name for p in out.iterdir())
    others = [n for n in names if n not in INDEX_ENTRIES]
    if others or (names and MANIFEST_FILE not in names):
        shown = ", ".join(others[:5] or names[:5]) + (" ..." if len(others or names) > 5 else "")
        where = f"beside its {MANIFEST_FILE}" if MANIFEST_FILE in names else f"and no {MANIFEST_FILE}"
        raise RetrieverError(f"{out} is not an index directory: it holds {shown} {where}; {expected}; "
                             "nothing was deleted")  # fmt: skip
    if corpus is not None and corpus.resolve().is_relative_to(out.resolve()):
        raise RetrieverError(f"{out} holds the corpus {corpus} being read; {expected}; nothing was deleted")
