"""The output folder: atomic JSON/text writes and the resumable record journal.

Each finished (prompt, method) record is appended to ``journal.jsonl`` and fsync'd, so an
interrupted benchmark loses at most the call in flight. ``settings.json`` pins what makes
records comparable (models, backend, decoding knobs); a run with other settings must not
mix its records into the same journal, so it is refused unless ``overwrite`` is set. The
selection (datasets, limits, methods) may change: a new run only adds the missing work.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

from nsd.errors import NSDError

JOURNAL = "journal.jsonl"
SETTINGS = "settings.json"
SUMMARY = "summary.json"  # results.json without the records: what the repository keeps of a run
OUTPUTS = ("results.json", SUMMARY, "report.md", JOURNAL, SETTINGS)


def jsonable(value: Any) -> Any:
    """Plain JSON: NaN becomes null and ±inf the strings "inf"/"-inf" (strict parsers
    reject the bare NaN/Infinity tokens Python would write)."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and ``os.replace``: readers see the old
    file or the new one, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # plain open: honours the umask
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any, indent: int | None = 2) -> None:
    """``indent=None``: one line, for data files read by programs, not people."""
    write_text_atomic(path, json.dumps(jsonable(data), indent=indent, ensure_ascii=False) + "\n")


def record_key(record: dict) -> tuple[str, str]:
    return record["prompt"], record["method"]


def read_journal(path: Path, key: Callable[[dict], tuple] = record_key
                 ) -> tuple[dict[tuple, dict], bool]:
    """The records of a journal by ``key(record)`` (a later line for the same key wins),
    and whether its last line was torn (the write in flight when a run was killed; it is
    left out). Read-only, so it is safe on a journal a live run is appending to; a corrupt
    line anywhere else is an error, not something to skip silently."""
    path = Path(path)
    if not path.is_file():
        return {}, False
    # Split on b"\n" only: records are written with ensure_ascii=False, so a text may hold
    # U+2028 or U+0085, which str.splitlines() would take for line ends. Decoding per line
    # lets a write cut inside a multi-byte character count as torn, not crash the reader.
    lines = [(number, raw) for number, raw in enumerate(path.read_bytes().split(b"\n"), 1)
             if raw.strip()]
    last = lines[-1][0] if lines else 0
    records: dict[tuple, dict] = {}
    for number, raw in lines:
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if number == last:
                return records, True
            raise NSDError(f"{path}:{number} is corrupt") from None
        try:
            records[key(record)] = record
        except (KeyError, TypeError, ValueError) as exc:  # whole JSON, but not a record
            raise NSDError(f"{path}:{number} is not a benchmark record "
                           f"({type(exc).__name__}: {exc})") from None
    return records, False


class Journal:
    """Finished records of one output folder, keyed by ``key(record)``: by default
    (prompt uid, method label); another benchmark may key by more fields.

    The settings are checked and the journal read at once. ``defer_writes``: nothing in
    the folder changes (not the folder itself, ``settings.json``, a repaired journal, or
    an ``overwrite``'s removal of the earlier run) until the first record is appended, so
    a run that cannot start (a model or peer program missing) leaves the folder as it was.

    ``added``: settings (by dotted path, ``generation.draft_context``) that an earlier run
    may lack because nsd gained them after it, each with the value that run behaved as
    having (the knob's default): such a run resumes when this one has that value.
    """

    def __init__(self, out_dir: Path, settings: dict, overwrite: bool = False,
                 key: Callable[[dict], tuple] = record_key, defer_writes: bool = False,
                 added: Mapping[str, Any] | None = None) -> None:
        self.key = key
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / JOURNAL
        self.settings = json.loads(json.dumps(jsonable(settings)))
        self.overwrite = overwrite
        self._pinned = False
        self._dirty = False  # the journal on disk needs rewriting from self.records
        _check_writable(self.out_dir)
        settings_path = self.out_dir / SETTINGS
        if overwrite:
            self.records: dict[tuple, dict] = {}
        else:
            if settings_path.is_file():
                try:
                    old = json.loads(settings_path.read_text(encoding="utf-8"))
                except (OSError, json.JSONDecodeError):
                    old = None
                added = json.loads(json.dumps(jsonable(dict(added or {}))))
                if changed := _changed(old, self.settings, added):
                    raise NSDError(f"{self.out_dir} holds a benchmark run with different settings "
                                   f"({changed}); use another --out "
                                   "folder or pass --overwrite to discard it")
            elif self.path.is_file() and self.path.stat().st_size:
                raise NSDError(f"{self.path} exists without {SETTINGS}; use another --out "
                               "folder or pass --overwrite")
            self.records = self._read()
        if not defer_writes:
            self.pin()

    def pin(self) -> None:
        """Make the folder this journal's: create it, remove an earlier run being
        overwritten, write ``settings.json`` and any pending rewrite of the journal. Once;
        appending a record does it first."""
        if self._pinned:
            return
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise NSDError(f"cannot create output folder {self.out_dir}: {exc.strerror}") from exc
        if self.overwrite:
            for name in OUTPUTS:
                (self.out_dir / name).unlink(missing_ok=True)
        write_json_atomic(self.out_dir / SETTINGS, self.settings)
        self._pinned = True
        if self._dirty:
            self._rewrite(self.records)

    def _read(self) -> dict[tuple, dict]:
        try:
            records, torn = read_journal(self.path, self.key)
        except NSDError as exc:
            raise NSDError(f"{exc}; pass --overwrite to start over") from None
        if torn:
            print(f"nsd: ignoring a truncated last line in {self.path}", file=sys.stderr)
        if torn or (self.path.is_file() and self.path.stat().st_size
                    and not self.path.read_bytes().endswith(b"\n")):
            self._dirty = True  # drop the partial line so appends start on a fresh one
        return records

    def _rewrite(self, records: dict[tuple, dict]) -> None:
        if not self._pinned:  # written when the folder is pinned
            self._dirty = True
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records.values())
        write_text_atomic(self.path, text)
        self._dirty = False

    def __contains__(self, key: tuple) -> bool:
        return key in self.records

    def __len__(self) -> int:
        return len(self.records)

    def drop_loaded_prompts(self) -> int:
        """Forget every record of each prompt that has a call flagged as run under load
        from other processes, so a resumed run times all its methods again, interleaved as
        before. Returns the number of prompts dropped."""
        loaded = {r["prompt"] for r in self.records.values() if r.get("load", {}).get("flagged")}
        if loaded:
            self.records = {k: r for k, r in self.records.items() if r["prompt"] not in loaded}
            self._rewrite(self.records)
        return len(loaded)

    def append(self, record: dict) -> None:
        self.pin()
        record = jsonable(record)
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[self.key(record)] = record


def _check_writable(folder: Path) -> None:
    """Fail now, not after the models load, where ``folder`` cannot be created or written:
    its nearest existing ancestor must be a writable folder."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NSDError(f"cannot create output folder {folder}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise NSDError(f"cannot create output folder {folder}: no permission to write in {existing}")


_UNSET = object()  # a key only one of the two settings has


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """``value``'s scalars (and lists, compared whole) by dotted path: ``generation.k``."""
    if not isinstance(value, dict) or (prefix and not value):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(_leaves(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _changed(old: Any, new: dict, added: Mapping[str, Any], shown: int = 4) -> str:
    """The settings that changed, as ``path: old -> new`` (empty: none did): just those,
    so that one changed knob is not lost in two whole dicts of them. A setting ``old``
    lacks that is in ``added`` with the value ``new`` has is not a change."""
    if not isinstance(old, dict):
        return f"unreadable {SETTINGS}"
    before, after = _leaves(old), _leaves(new)
    keys = sorted(k for k in before.keys() | after.keys()
                  if before.get(k, _UNSET) != after.get(k, _UNSET)
                  and not (k not in before and k in added and after.get(k, _UNSET) == added[k]))

    def text(value: Any) -> str:
        return "unset" if value is _UNSET else repr(value)

    lines = [f"{k}: {text(before.get(k, _UNSET))} -> {text(after.get(k, _UNSET))}" for k in keys[:shown]]
    more = len(keys) - shown
    return "; ".join(lines) + (f"; and {more} more" if more > 0 else "")
