"""Files kvmerge writes whole: written beside their place, then renamed over it."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def written(path: Path):
    """`with written(path) as tmp:` write the file at `tmp` (hidden, beside `path`, named by this
    process); when the block ends without an error it is published over `path` (`publish`), else
    removed. Two processes writing one path each write their own; the last to finish wins whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def publish(tmp: Path, path: Path) -> Path:
    """Rename the finished `tmp` over `path` (a reader sees the old file or the whole new one, never
    half of one), with the permissions the user's umask gives any new file (a temporary file may be
    private; a file replaced gets them too). Not for threads: it reads the process's umask by
    setting it."""
    Path(tmp).replace(path)
    umask = os.umask(0)
    os.umask(umask)
    Path(path).chmod(0o666 & ~umask)
    return Path(path)
