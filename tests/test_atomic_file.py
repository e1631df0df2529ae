"""``write_text_atomic``: whole or nothing, and the file keeps the mode it had (before: every
rewrite left the temporary file's 0600, so a policy others read, 0644, became unreadable to
them; a new file got 0600 instead of what ``open(path, "w")`` gives)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from semkv.atomic_file import current_umask, write_text_atomic


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mode", [0o644, 0o600, 0o640, 0o444])
def test_a_rewritten_file_keeps_its_mode(tmp_path: Path, mode: int):
    path = tmp_path / "policy.json"
    path.write_text("old")
    path.chmod(mode)
    write_text_atomic(path, "new")
    assert path.read_text() == "new" and _mode(path) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["policy.json"]  # no temporary file left


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_new_file_gets_what_open_would_give(tmp_path: Path, umask: int):
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        write_text_atomic(tmp_path / "a" / "new.json", "x")
        (tmp_path / "plain.json").write_text("x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a" / "new.json") == _mode(tmp_path / "plain.json") == 0o666 & ~umask


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path):
    path = tmp_path / "policy.json"
    path.write_text("old")

    with pytest.raises(TypeError):
        write_text_atomic(path, 42)  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["policy.json"]
