"""How often each token of a vocabulary occurs in a corpus: what a reduced draft
vocabulary keeps.

The corpus must be present on every machine nsd runs on and must not be a benchmark, so
the ranking cannot be tuned to the prompts it is measured on. We use what the running
interpreter ships: its standard library's Python sources (code, comments, docstrings) and
text files, test folders left out (they hold deliberately odd data), and the documentation
of the installed packages — each distribution's METADATA (its README, mostly Markdown:
prose, lists, code fences, which the standard library alone lacks) and its .md/.rst/.txt
files. About 14 MB with nsd's own dependencies, tokenized in a few seconds once per draft
file; the counts are cached next to the file. The files are read in sorted order and
every count is a plain sum, so the same interpreter and installed packages always give the
same counts.

Tokenization is llama.cpp's own (the draft GGUF loaded vocabulary-only), with special
tokens parsed as text: the counts are what the draft would be fed for these bytes.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np

from nsd.errors import NSDError
from nsd.models.markers import ensure_artefact

CORPUS_SUFFIXES = (".py", ".txt", ".rst", ".md")  # standard library files
DOC_SUFFIXES = (".md", ".rst", ".txt")  # installed packages' documentation files
_SKIP_PARTS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                         "__pycache__"})


def corpus_roots() -> list[Path]:
    """The standard library, then each distinct installed-packages folder."""
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"])]
    for key in ("purelib", "platlib"):
        root = Path(paths[key])
        if root.is_dir() and root not in roots:
            roots.append(root)
    return roots


def corpus_files(roots: list[Path] | None = None) -> list[Path]:
    """The corpus, in a fixed order: under the first root (the standard library) its
    sources and text files, test folders left out; under the others (installed packages)
    only documentation: each distribution's ``METADATA`` (its README, as a rule in
    Markdown) and Markdown, reStructuredText and text files. Sorted by path within a root."""
    roots = corpus_roots() if roots is None else roots
    files: list[Path] = []
    for i, root in enumerate(roots):
        def wanted(p: Path) -> bool:
            if i == 0:
                return p.suffix in CORPUS_SUFFIXES and not (_SKIP_PARTS & set(p.relative_to(root).parts[:-1]))
            return p.suffix in DOC_SUFFIXES or (p.name == "METADATA" and p.parent.suffix == ".dist-info")
        found = [p for p in root.rglob("*") if wanted(p) and p.is_file()]
        files += sorted(found, key=lambda p: p.relative_to(root).as_posix())
    return files


def describe_corpus(roots: list[Path] | None = None) -> str:
    roots = corpus_roots() if roots is None else roots
    files = corpus_files(roots)
    size = sum(p.stat().st_size for p in files)
    return (f"Python {sys.version.split()[0]} standard library and installed packages' "
            f"documentation ({', '.join(map(str, roots))}): {len(files)} files, {size / 1e6:.1f} MB")


def rank(counts: np.ndarray) -> np.ndarray:
    """Token ids, most frequent first; ties (unseen tokens included) by ascending id."""
    ids = np.arange(len(counts))
    return np.lexsort((ids, -np.asarray(counts, dtype=np.int64)))


def count_tokens(gguf_path: Path, texts: Iterable[bytes]) -> np.ndarray:
    """``[n_vocab]`` int64 counts of the tokens llama.cpp's tokenizer for ``gguf_path``
    gives ``texts`` (each tokenized alone, no BOS, special tokens as plain text)."""
    from nsd.backends.llama_cpp import import_llama_cpp, llama_log

    lib = import_llama_cpp()
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    llama_log.held = []  # a Qwen vocabulary logs harmless "control-looking token" errors
    try:
        model = lib.llama_model_load_from_file(str(gguf_path).encode(), params)
    finally:
        held, llama_log.held = llama_log.held, None
    if not model:
        detail = "; ".join(line.strip() for line in held if line.strip())
        raise NSDError(f"llama.cpp could not read the vocabulary of {gguf_path}: {detail or 'invalid file?'}")
    try:
        vocab = lib.llama_model_get_vocab(model)
        n_vocab = int(lib.llama_vocab_n_tokens(vocab))
        counts = np.zeros(n_vocab, dtype=np.int64)
        cap = 1 << 16
        buf = (ctypes.c_int32 * cap)()
        for text in texts:
            # Invalid UTF-8 (a few Latin-1 sources) is replaced, as a text editor would show it.
            data = text.decode("utf-8", errors="replace").encode("utf-8")
            n = lib.llama_tokenize(vocab, data, len(data), buf, cap, False, False)
            if n < 0:  # too small: -n tokens are needed
                cap = -n
                buf = (ctypes.c_int32 * cap)()
                n = lib.llama_tokenize(vocab, data, len(data), buf, cap, False, False)
                if n < 0:
                    raise NSDError(f"llama.cpp could not tokenize a corpus text ({n})")
            counts += np.bincount(np.frombuffer(buf, dtype=np.int32, count=n), minlength=n_vocab)
        return counts
    finally:
        lib.llama_model_free(model)


def counts_path(gguf_path: Path) -> Path:
    return gguf_path.with_name(f"{gguf_path.stem}.token-counts.npy")


def ensure_token_counts(gguf_path: Path) -> np.ndarray:
    """The corpus token counts for ``gguf_path``'s vocabulary (computed once, cached)."""
    target = counts_path(gguf_path)

    def build(tmp: Path) -> None:
        print(f"nsd: ranking the tokens of {gguf_path.name} by frequency in the {describe_corpus()} "
              "(once; cached)", file=sys.stderr)
        counts = count_tokens(gguf_path, (p.read_bytes() for p in corpus_files()))
        with open(tmp, "wb") as out:
            np.save(out, counts)

    ensure_artefact(target, build, f"the token counts of {gguf_path.name}")
    return np.load(target)
