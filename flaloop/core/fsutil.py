"""Files that are either the old version or the new one, never half of each.

Every record and cache flaloop keeps (contract.json, docs/draft.md, gate/last.json, gate
baselines, bench run records, .git/info/exclude) is written through `atomic_write_text`: the
text goes to a temp file in the same directory, is fsynced, and replaces the target with
`os.replace` (atomic on POSIX within one file system). A crash, a kill or a full disk leaves
the previous file intact and no temp file behind.

A full disk cannot be made on demand in a test, so the writer honours one test-only variable:
`FLALOOP_TEST_ENOSPC=<substring>` makes every write whose path contains the substring write
half its bytes and then fail with ENOSPC, exactly as a disk that fills up mid-write would.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

from flaloop.core.errors import StorageError

ENOSPC_ENV = "FLALOOP_TEST_ENOSPC"


def atomic_write_text(path: Path | str, text: str) -> Path:
    """Replace `path` with `text` atomically; StorageError (exit 2) when the disk says no."""
    path = Path(path)
    data = text.encode()
    tmp_name = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, _mode_for(path))  # mkstemp makes 0600; keep what the file had, or the umask's
        with os.fdopen(fd, "wb") as fh:
            _write(fh, data, str(path))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, path)
        tmp_name = None
    except OSError as exc:
        raise storage_error(exc, path) from exc
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass
    return path


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def atomic_write_json(path: Path | str, obj, indent: int | None = 1) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


def user_cache_dir() -> Path:
    """flaloop's cache outside any repo: `$XDG_CACHE_HOME/flaloop`, else `~/.cache/flaloop`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flaloop"


def read_json_cache(path: Path):
    """A cache's JSON, or None when it is missing or damaged (a cache is recomputed, never trusted
    half-written: files from before atomic writes, or edited by hand)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _write(fh, data: bytes, path: str) -> None:
    marker = os.environ.get(ENOSPC_ENV)
    if marker and marker in path:
        fh.write(data[: len(data) // 2])
        fh.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    fh.write(data)


def storage_error(exc: OSError, path: Path | str) -> StorageError:
    """A user-facing error for a file flaloop could not write or create."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "free some disk space (`flaloop clean OP --keep N` prunes old run records) and rerun"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = f"make {Path(path).parent} writable for this user (or run from a writable checkout)"
    else:
        hint = f"check that {Path(path).parent} is a writable directory"
    return StorageError(f"cannot write {path}: {reason}", hint)


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (0 when it does not exist); links not followed."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue  # removed while we looked
    return total


def unique_dir(parent: Path, name: str) -> Path:
    """A new directory `parent/name`, or `name-2`, `name-3`, ... when that one exists already
    (two runs in the same second must never share a run directory)."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for i in range(1, 1000):
            d = parent / (name if i == 1 else f"{name}-{i}")
            try:
                d.mkdir()
                return d
            except FileExistsError:
                continue
    except OSError as exc:
        raise storage_error(exc, parent / name) from exc
    raise StorageError(f"could not find a free name for {parent / name}")
