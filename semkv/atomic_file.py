"""Files written whole or not at all: a reader never sees half a policy, rows file or cache.

``write_text_atomic(path, text)`` writes a temporary file beside ``path`` (same folder, so the
same file system), flushes it to disk, then renames it over ``path`` (``os.replace``, atomic on
POSIX): a crash or a full disk leaves the old file, never a truncated one, and no temporary
file behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
