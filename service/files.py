"""Files written whole: a reader (a server polling the model repository, the next run reading a cache) sees the old
file or the new one, never a part, and a run stopped while writing leaves no part behind."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A hidden path beside ``path`` to write to; when the block ends, it replaces ``path``, or on an error is
    removed. Its mode is an ordinary new file's (0666 less the umask), so that another user (a container's) can read
    what was written here."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole (:func:`replacing`), flushed to the disk before it replaces the old file."""
    with replacing(path) as tmp, tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
