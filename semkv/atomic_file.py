"""Files written whole or not at all: a reader never sees half a policy, rows file or cache.

``write_text_atomic(path, text)`` writes a temporary file beside ``path`` (same folder, so the
same file system), flushes it to disk, then renames it over ``path`` (``os.replace``, atomic on
POSIX): a crash or a full disk leaves the old file, never a truncated one, and no temporary
file behind. The file gets the mode it had (a rewritten 0644 policy stays 0644, a 0600 one
0600), or, when new, the mode ``open(path, "w")`` would give it (0666 less the umask), not the
temporary file's 0600.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~current_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
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


def current_umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets one to read it, which
    would race with other threads creating files), from /proc where Linux has it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
