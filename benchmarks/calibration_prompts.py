"""Write ``benchmarks/data/calibration_prompts.jsonl``: held-out prompts for calibrating nsd.

The stored acceptance priors of ``-k auto`` (``src/nsd/draftlen/priors.py``) must come from text
that is not a benchmark nsd is judged on. These prompts are built from Python's own
standard library (present wherever nsd runs, and neither HumanEval nor Spec-Bench): raw
completion of a function from its signature and docstring, a function written from its
description, code to edit, code to explain and documentation to summarise, four of each.
The file is committed, so the calibration does not depend on the Python version that
regenerates it.

    python benchmarks/calibration_prompts.py  [--out benchmarks/data/calibration_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

# (module, function): short pure-Python functions with a docstring.
COMPLETE = [("fnmatch", "filter"), ("calendar", "leapdays"), ("statistics", "mean"),
            ("shlex", "join")]
WRITE = [("string", "capwords"), ("genericpath", "commonprefix"), ("html", "escape"),
         ("calendar", "weekday")]
EDIT = [("textwrap", "indent"), ("fnmatch", "fnmatchcase"), ("shlex", "quote"),
        ("colorsys", "rgb_to_hls")]
EXPLAIN = [("difflib", "get_close_matches"), ("statistics", "median"), ("calendar", "isleap"),
           ("base64", "b16decode")]
SUMMARIZE = ["heapq", "difflib", "json", "argparse"]
DOC_CHARS = 2000  # a long module docstring is cut at a paragraph boundary near this


def _function(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def _doc(fn) -> str:
    return inspect.cleandoc(fn.__doc__ or "")


def rows() -> list[dict]:
    out = []
    for module, name in COMPLETE:
        fn = _function(module, name)
        doc = textwrap.indent(_doc(fn), "    ").lstrip()
        out.append({"id": f"complete-{name}", "category": "complete", "chat": False,
                    "prompt": f"def {name}{inspect.signature(fn)}:\n    \"\"\"{doc}\n    \"\"\"\n"})
    for module, name in WRITE:
        fn = _function(module, name)
        out.append({"id": f"write-{name}", "category": "write",
                    "prompt": f"Write a Python function `{name}{inspect.signature(fn)}` that does "
                              f"the following:\n\n{_doc(fn)}"})
    for module, name in EDIT:
        source = inspect.getsource(_function(module, name))
        out.append({"id": f"edit-{name}", "category": "edit",
                    "prompt": "Add type hints to this function and return the whole function:"
                              f"\n\n```python\n{source}```"})
    for module, name in EXPLAIN:
        source = inspect.getsource(_function(module, name))
        out.append({"id": f"explain-{name}", "category": "explain",
                    "prompt": f"Explain what this code does, step by step:\n\n```python\n{source}```"})
    for module in SUMMARIZE:
        doc = inspect.cleandoc(importlib.import_module(module).__doc__ or "")
        if len(doc) > DOC_CHARS:
            cut = doc.rfind("\n\n", 0, DOC_CHARS)
            doc = doc[:cut if cut > 0 else DOC_CHARS]
        out.append({"id": f"summarize-{module}", "category": "summarize",
                    "prompt": f"Summarize this documentation in a few sentences:\n\n{doc}"})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "data" / "calibration_prompts.jsonl")
    args = parser.parse_args()
    text = "".join(json.dumps(r) + "\n" for r in rows())
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=".calibration-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, args.out)  # atomic: never a half-written file
    print(f"wrote {args.out} ({text.count(chr(10))} prompts, Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
