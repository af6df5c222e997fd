"""Completion markers: how nsd knows a cached artefact is whole before it uses it.

Every cached file or folder (a joined GGUF, a tokenizer or conversion folder, a
reduced-vocabulary or re-quantized GGUF) is built under a temporary name, renamed into
place, and only then gets its marker, written last and atomically. The marker records
the size, mtime and SHA-256 of every file of the artefact:

* a file ``x.gguf`` has its marker beside it, ``x.gguf.verified``;
* a folder ``hf/`` has its marker inside, ``hf/.verified``.

:func:`check_marker` is the cheap test run on every start: it only compares sizes and
mtimes, and re-hashes a file just when its mtime changed but its size did not (someone
touched or rewrote it). ``rehash=True`` (``nsd models verify``) always re-hashes. An
artefact without a marker was interrupted before it was finished, or predates markers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

_CHUNK_BYTES = 4 << 20
_QUIET_BELOW = 64 << 20  # small files hash in a blink: no progress bar for them
FOLDER_MARKER = ".verified"
FILE_MARKER_SUFFIX = ".verified"
NO_MARKER = "no completion marker: it was interrupted while being written"


def marker_path(path: Path) -> Path:
    return path / FOLDER_MARKER if path.is_dir() else path.with_name(path.name + FILE_MARKER_SUFFIX)


def sha256_file(path: Path, *, progress: bool = False) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as src, tqdm(total=size, unit="B", unit_scale=True,
                                       unit_divisor=1024, desc=f"hashing {path.name}",
                                       disable=not progress or size < _QUIET_BELOW) as bar:
        while chunk := src.read(_CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _members(path: Path) -> dict[str, Path]:
    """The files a marker covers, by relative name ("" for a single file)."""
    if not path.is_dir():
        return {"": path}
    return {p.relative_to(path).as_posix(): p for p in sorted(path.rglob("*"))
            if p.is_file() and not p.name.startswith(FOLDER_MARKER)}


def _entry(file: Path, sha256: str) -> dict[str, object]:
    stat = file.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}


def write_marker(path: Path, sha256: str | None = None, *, progress: bool = False) -> None:
    """Record ``path`` (a finished file or folder) as complete; call it last.

    ``sha256`` is the file's hash when the caller has just computed it (while writing,
    or against a pinned value); otherwise every file is hashed here.
    """
    entries = {}
    for name, file in _members(path).items():
        digest = sha256 if (sha256 and name == "") else sha256_file(file, progress=progress)
        entries[name] = _entry(file, digest)
    write_json_atomically(marker_path(path), {"version": 1, "files": entries})


def remove_marker(path: Path) -> None:
    marker_path(path).unlink(missing_ok=True)


def check_marker(path: Path, *, rehash: bool = False, expected_sha256: str | None = None,
                 progress: bool = False) -> str | None:
    """``None`` if ``path`` is complete and unchanged since its marker; else what is wrong.

    ``expected_sha256`` (a single file with a pinned hash) is ground truth: a file without
    a marker is hashed against it and, when it matches, gets its marker now.
    """
    if not path.exists():
        return "it does not exist"
    try:
        recorded = json.loads(marker_path(path).read_text(encoding="utf-8"))["files"]
    except FileNotFoundError:
        if expected_sha256 is None or path.is_dir():
            return NO_MARKER
        actual = sha256_file(path, progress=progress)
        if actual != expected_sha256:
            return f"its SHA-256 is {actual}, not the pinned {expected_sha256}"
        write_marker(path, actual)
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return "its completion marker is unreadable"
    current = _members(path)
    refreshed = dict(recorded)
    for name, entry in recorded.items():
        label = name or path.name
        file = current.get(name)
        if file is None:
            return f"{label} is missing"
        if expected_sha256 is not None and entry.get("sha256") != expected_sha256:
            return "it was checked against another SHA-256 than the pinned one"
        stat = file.stat()
        if stat.st_size != entry.get("size"):
            return f"{label} has {stat.st_size} bytes, {entry.get('size')} were written"
        if rehash or stat.st_mtime_ns != entry.get("mtime_ns"):
            if sha256_file(file, progress=progress) != entry.get("sha256"):
                return f"{label} does not match the SHA-256 recorded when it was written"
            refreshed[name] = {**entry, "mtime_ns": stat.st_mtime_ns}
    if refreshed != recorded:  # same bytes, new mtime: record it so the next start need not hash
        write_json_atomically(marker_path(path), {"version": 1, "files": refreshed})
    return None


def ensure_artefact(target: Path, build: Callable[[Path], None], what: str,
                    adopt: Callable[[Path], None] | None = None) -> Path:
    """Return ``target`` once it is complete, building it if it is missing or damaged.

    ``build(tmp)`` writes the artefact at ``tmp`` (a file or a folder); it is renamed into
    place and only then marked. ``adopt(target)`` may vouch for an unmarked artefact (one
    finished before markers existed, or whose writer died between rename and marker) by
    returning without raising; it is then marked instead of rebuilt.
    """
    problem = check_marker(target)
    if problem is None:
        return target
    if target.exists():
        if problem == NO_MARKER and adopt is not None and _vouched(adopt, target):
            write_marker(target, progress=True)  # one-time hash; bars only for big files
            return target
        notice(f"{what} in {target} is damaged ({problem}); rebuilding it")
        remove_artefact(target)
    remove_stale_temps(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(target, "tmp")
    try:
        build(tmp)
    except BaseException:  # including Ctrl-C: never leave a half-written temp behind
        remove_artefact(tmp)
        raise
    try:
        os.replace(tmp, target)
    except OSError:
        remove_artefact(tmp)
        if check_marker(target) is None:
            return target  # another process finished the same build first
        raise
    write_marker(target)
    return target


def _vouched(adopt: Callable[[Path], None], target: Path) -> bool:
    from nsd.errors import NSDError

    try:
        adopt(target)
    except NSDError:
        return False
    return True


def notice(message: str) -> None:
    """One line on stderr about a repair nsd makes on its own."""
    print(f"nsd: {message}", file=sys.stderr, flush=True)


def remove_artefact(path: Path) -> None:
    """Delete a damaged artefact and its marker (the marker first: never a stale one)."""
    remove_marker(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def temp_path(target: Path, kind: str = "partial") -> Path:
    """A temporary name beside ``target``; the pid lets later runs spot dead writers."""
    return target.with_name(f"{target.name}.{kind}-{os.getpid()}")


def remove_stale_temps(target: Path) -> None:
    """Remove temporaries of ``target`` left by writers that were killed mid-write."""
    if not target.parent.is_dir():
        return
    for kind in ("partial", "tmp"):
        for tmp in target.parent.glob(f"{target.name}.{kind}-*"):
            pid = tmp.name.rsplit("-", 1)[-1]
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue  # another nsd is writing it right now
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def write_json_atomically(path: Path, value: object) -> None:
    tmp = temp_path(path)
    try:
        tmp.write_text(json.dumps(value, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
