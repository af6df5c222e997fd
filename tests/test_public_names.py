"""Every public name of every nsd package imports: ``from nsd.models import *`` and each
name in each package's ``__all__`` (lazy re-exports point at modules that exist)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import nsd


def _packages() -> list[str]:
    names = ["nsd"]
    for info in pkgutil.walk_packages(nsd.__path__, "nsd."):
        # The vLLM plugin's package needs vLLM itself; tests/in_vllm covers it.
        if info.ispkg and not info.name.startswith("nsd.integrations"):
            names.append(info.name)
    return names


def test_star_import_of_models() -> None:
    namespace: dict = {}
    exec("from nsd.models import *", namespace)
    assert {"check_gguf", "GGUFInfo", "check_hf_folder", "load_backend"} <= set(namespace)


@pytest.mark.parametrize("package", _packages())
def test_every_name_in_all_imports(package: str) -> None:
    module = importlib.import_module(package)
    for name in getattr(module, "__all__", ()):
        assert getattr(module, name) is not None, f"{package}.{name}"


def test_vllm_extra_installs_a_version_the_plugin_supports() -> None:
    import tomllib
    from pathlib import Path

    from nsd.integrations.vllm.config import SUPPORTED_TEXT

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["vllm"] == [f"vllm{SUPPORTED_TEXT}"]


def test_engine_by_name_points_to_load_engine() -> None:
    # Engine() takes loaded models now; the old call by name gets a one-line refusal that
    # names the factory, not an AttributeError from deep inside.
    from nsd.api import Engine
    from nsd.errors import NSDError

    with pytest.raises(NSDError, match="load_engine"):
        Engine("qwen2.5-coder-1.5b-instruct", None)
