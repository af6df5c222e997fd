"""OpenAI's limits on the request fields (temperature, stop strings, legacy logprobs, the
body's media type), and the server's flag that raises the stop-string limit."""

from __future__ import annotations

import httpx
import pytest

from nsd.api import GenerationConfig
from nsd.cli import main
from nsd.errors import NSDError
from nsd.serve import ServerConfig
from serve_support import mock_engine, running_server

DEFAULTS = GenerationConfig(method="sd", max_new_tokens=4, k=2)


@pytest.fixture(scope="module")
def server():
    with running_server(mock_engine(), ServerConfig(model_name="mock", defaults=DEFAULTS)) as (url, _):
        with httpx.Client(base_url=url, timeout=30) as client:
            yield client


def _completion(client: httpx.Client, **fields) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "mock", "prompt": "abcabc", **fields})


def _refused(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value", error
    for word in words:
        assert word in error["message"], error["message"]


@pytest.mark.parametrize("value, ok", [(0, True), (2, True), (2.0000001, False), (1e6, False),
                                       (-0.1, False)])
def test_temperature_is_within_openais_range(server, value: float, ok: bool) -> None:
    r = _completion(server, temperature=value)
    if ok:
        assert r.status_code == 200, r.text
    else:
        _refused(r, "temperature", "temperature")
        if value > 2:
            assert "[0, 2]" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_at_most_four_stop_strings_and_the_400_names_the_flag(server, path: str) -> None:
    prompt = {"prompt": "abcabc"} if path == "/v1/completions" else \
        {"messages": [{"role": "user", "content": "abc"}]}
    stops = [f"zz{i}" for i in range(5)]
    r = server.post(path, json={"model": "mock", **prompt, "stop": stops[:4]})
    assert r.status_code == 200, r.text
    r = server.post(path, json={"model": "mock", **prompt, "stop": stops})
    _refused(r, "stop", "at most 4", "got 5", "--max-stop")


def test_the_flag_raises_the_stop_limit() -> None:
    config = ServerConfig(model_name="mock", defaults=DEFAULTS, max_stop=10)
    with running_server(mock_engine(), config) as (url, _):
        stops = [f"zz{i}" for i in range(11)]
        assert _completion(httpx.Client(base_url=url), stop=stops[:10]).status_code == 200
        _refused(_completion(httpx.Client(base_url=url), stop=stops), "stop", "at most 10")
    with pytest.raises(NSDError, match="max_stop"):
        ServerConfig(model_name="mock", max_stop=0)


def test_the_max_stop_flag_is_checked_by_the_cli(capsys) -> None:
    assert main(["serve", "--target", "nothing-here", "--max-stop", "0"]) != 0
    err = capsys.readouterr().err
    assert "--max-stop" in err and "Traceback" not in err


@pytest.mark.parametrize("value, ok", [(5, True), (6, False)])
def test_legacy_logprobs_at_most_five(server, value: int, ok: bool) -> None:
    r = _completion(server, logprobs=value)
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"


@pytest.mark.parametrize("content_type, status", [
    ("application/json", 200), ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200), (None, 200),
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("multipart/form-data", 415),
])
def test_a_body_declared_as_anything_but_json_is_415(server, content_type, status) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    for path, body in (("/v1/completions", b'{"model": "mock", "prompt": "abc"}'),
                       ("/v1/chat/completions",
                        b'{"model": "mock", "messages": [{"role": "user", "content": "a"}]}')):
        r = server.post(path, content=body, headers=headers)
        assert r.status_code == status, r.text
        if status == 415:
            error = r.json()["error"]
            assert error["code"] == "unsupported_media_type" and content_type in error["message"]
