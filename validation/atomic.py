"""One way to replace a file whole: evidence, reports, gate outputs and the agent's records all
go through it, so a reader (or an interrupted run) sees the old file or the new one, never a part."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path, text: str, *, mode: int = 0o644) -> Path:
    """Write `text` to `path` exactly as given (no newline translation): a temporary file in the
    same folder, flushed and fsynced, given `mode`, then os.replace; the rename is made durable
    where the filesystem allows. On any failure the temporary file is removed and `path` is
    untouched. Creates the parent folder. Returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)  # mkstemp makes the file private
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return p
