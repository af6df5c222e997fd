"""The OpenAI wire format: request models, error objects, response and chunk bodies.

Requests are validated strictly (a string where a number belongs is an error, not a
conversion) so that every mistake becomes a 400 naming the field instead of a surprise.
No field is ignored: each OpenAI field is either honoured or refused with a 400 that names
it (:data:`REFUSED` says why for those nsd does not implement), and a field OpenAI does not
define is refused as unknown, at the top level, in a message and in ``stream_options``;
the ``nsd`` object is ours. JSON ``null`` in an optional field means "not set" (the
server's setting applies), as in OpenAI's API, in the ``nsd`` object too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from typing import Any, Callable, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model,
                      field_validator)

from nsd import options as optspec
from nsd.api import GenerationConfig, GenerationResult, method_report
from nsd.generation import TokenInfo
from nsd.errors import NSDError


# A JSON escape of half a UTF-16 pair ("\ud800") decodes to a lone surrogate, which is no
# Unicode character: tokenizers and UTF-8 encoders raise on it.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")

TOOLS_UNSUPPORTED = "nsd serve does not implement tool calling"

# OpenAI's limits (its API reference), where they are narrower than nsd's own options':
# alternatives per token (chat's top_logprobs; the completions' legacy logprobs), and the
# temperature (nsd itself takes any finite one).
MAX_TOP_LOGPROBS = 20
MAX_LEGACY_LOGPROBS = 5
MAX_TEMPERATURE = 2.0
LOGIT_BIAS_RANGE = 100.0

# OpenAI fields nsd does not implement, refused (400 naming the field) whenever they ask for
# something; the value each may still take (what asks for nothing) is in the check below.
REFUSED = {
    "echo": "echoing the prompt is not supported",
    "suffix": "insertion (a suffix after the completion) is not supported",
    "best_of": "best_of > 1 is not supported (one sequence per request)",
    "response_format": "only response_format {\"type\": \"text\"} is supported: JSON output "
                       "would need the same grammar constraint on target and draft, which nsd "
                       "does not implement",
    "tool_choice": f"tool_choice must be \"none\" ({TOOLS_UNSUPPORTED})",
    "audio": "audio output is not supported",
    "modalities": "only the text modality is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported",
    "web_search_options": "web search is not supported",
    "store": "storing completions is not supported",
    "metadata": "metadata is only stored with store, which is not supported",
    "service_tier": "service tiers are not supported",
}


def _asks_nothing(name: str, value: Any) -> bool:
    """Whether ``value`` of the refused field ``name`` asks for nothing (the default)."""
    if value is None:
        return True
    return {
        "echo": value is False,
        "suffix": value == "",
        "best_of": type(value) is int and value == 1,
        "response_format": isinstance(value, dict) and value == {"type": "text"},
        "tool_choice": value == "none",
        "modalities": value == ["text"],
        "store": value is False,
        "metadata": value == {},
        "service_tier": value in ("auto", "default"),
    }.get(name, False)


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type_, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _nsd_field(name: str) -> tuple[Any, Any]:
    option = optspec.ALL[name]
    return Any, Field(None, description=f"{option.help} ({option.range_text()}; default: the server's "
                                        f"{option.flag})")


def _check_option(cls: type, value: Any, info: ValidationInfo) -> Any:
    if value is None:  # JSON null: not set, so the server's setting applies
        return None
    try:
        return optspec.check(info.field_name, value)
    except NSDError as err:  # "theta must be ..." -> "must be ...": the field is named anyway
        raise ValueError(str(err).removeprefix(f"{info.field_name} ")) from None


# The ``nsd`` extra body field: the rule and draft-length options of nsd.options, with the
# names, ranges and help defined there; anything left out takes the server's flag.
NsdOptions = create_model(
    "NsdOptions",
    __config__=ConfigDict(extra="forbid"),
    __validators__={"check_option": field_validator("*", mode="before")(classmethod(_check_option))},
    **{name: _nsd_field(name) for name in (*optspec.RULE, *optspec.DRAFT_LENGTH)},
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    # OpenAI pads streamed chunks with random characters (on by default there) so their
    # sizes say nothing of the tokens; nsd sends no padding, so it takes only "off".
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _check_obfuscation(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("nsd pads no streamed chunk; send false or leave it out")
        return value


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: Any = None
    seed: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None  # an end-user id for the operator's logs: no effect on output
    parallel_tool_calls: bool | None = None  # meaningless without tools, which are refused
    tools: Any = None
    functions: Any = None  # tools' deprecated predecessor
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    nsd: NsdOptions | None = None  # type: ignore[valid-type]

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise ValueError("must be a string or a list of strings")

    # OpenAI fields nsd does not implement: a value that asks for something is refused.
    echo: Any = None
    suffix: Any = None
    best_of: Any = None
    response_format: Any = None
    tool_choice: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    # The sampling fields are nsd's options under OpenAI's names: checked by their specs.
    _check_sampling = field_validator("top_p", "top_k", "min_p", "seed", "presence_penalty",
                                      "frequency_penalty", mode="before")(classmethod(_check_option))

    @field_validator("temperature", mode="before")
    @classmethod
    def _check_temperature(cls, value: Any, info: ValidationInfo) -> Any:
        value = _check_option(cls, value, info)
        if value is not None and value > MAX_TEMPERATURE:
            raise ValueError(f"must be a number in [0, {MAX_TEMPERATURE:g}] (OpenAI's range), "
                             f"got {value!r}")
        return value

    @field_validator(*REFUSED, mode="before")
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        if not _asks_nothing(info.field_name, value):
            raise ValueError(f"{REFUSED[info.field_name]} (got {json.dumps(value)[:80]})")
        return None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _check_logit_bias(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("must be an object mapping token ids to biases")
        for key, bias in value.items():
            if not (isinstance(key, str) and key.isdigit() and key.isascii()):
                raise ValueError(f"key {key!r} is not a token id (a string of digits)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or \
                    not (math.isfinite(bias) and -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE):
                raise ValueError(f"the bias of token {key} must be a number in "
                                 f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {bias!r}")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def top_logprobs_asked(self) -> int | None:
        """How many alternatives to report per token (None: no logprobs at all)."""
        raise NotImplementedError

    @field_validator("tools", "functions")
    @classmethod
    def _check_tools(cls, value: Any) -> None:
        # An empty list asks for nothing; anything else would be silently ignored otherwise.
        if value:
            raise ValueError(f"tools are not supported ({TOOLS_UNSUPPORTED})")
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def requested_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the older ``max_tokens`` when both are set."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def prompt_param(self) -> str:
        return "prompt"


class CompletionRequest(_GenerationRequest):
    prompt: Any  # a string, or token ids; one prompt per request
    # The legacy form: an int, that many alternatives per token besides the chosen one.
    logprobs: int | None = Field(None, ge=0, le=MAX_LEGACY_LOGPROBS)

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> str | list[int]:
        # OpenAI also allows a list of prompts; a list holding one is unwrapped.
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
            value = value[0]
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value and all(type(t) is int for t in value):
            return value
        if isinstance(value, list) and len(value) > 1 and all(isinstance(p, str) for p in value):
            raise ValueError("several prompts in one request are not supported; send one per request")
        raise ValueError("must be a string or a list of token ids")


TOOL_ROLES = ("tool", "function")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # OpenAI's newer "developer" role plays the system role.
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = Field(None, validate_default=True)  # may be left out by an assistant turn
    # The participant's name: given to the chat template, and refused (by the app, which
    # can render it) where the template does not show it.
    name: str | None = None
    tool_calls: Any = None
    function_call: Any = None  # tool_calls' deprecated predecessor
    # OpenAI's other assistant-message fields (a client may send a response's message back
    # as the next turn with them null): null asks for nothing; a refusal or an audio turn
    # is one nsd cannot render, so it is refused.
    refusal: Any = None
    audio: Any = None
    annotations: Any = None  # url citations of a web search answer

    @field_validator("role", mode="before")
    @classmethod
    def _check_role(cls, value: Any) -> Any:
        # Without this, a tool result would only hear that its role is not in the list.
        if value in TOOL_ROLES:
            raise ValueError(f"role {value!r} is not supported ({TOOLS_UNSUPPORTED})")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> str:
        if isinstance(value, str):
            return value
        if value is None and info.data.get("role") == "assistant":
            # OpenAI lets an assistant turn leave content out or null (it then carries tool
            # calls, refused below); as a turn of the conversation it is an empty one.
            return ""
        if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and isinstance(p.get("text"), str) for p in value):
            return "".join(p["text"] for p in value)
        if value is None:
            raise ValueError("this field is required (a string or a list of text parts)")
        raise ValueError("must be a string or a list of text parts")

    @field_validator("tool_calls", "function_call")
    @classmethod
    def _check_tool_calls(cls, value: Any) -> None:
        if value:
            raise ValueError(f"tool calls are not supported ({TOOLS_UNSUPPORTED})")
        return None

    @field_validator("refusal", "audio", "annotations")
    @classmethod
    def _check_output_fields(cls, value: Any, info: ValidationInfo) -> None:
        # null, or an empty list of annotations, as a response's message carries them
        if value is not None and not (info.field_name == "annotations" and value == []):
            raise ValueError(f"an assistant's {info.field_name} cannot be rendered as a turn "
                             "of the conversation (give it as content, or leave it out)")
        return None

    def as_dict(self, name: bool = True) -> dict[str, str]:
        """The message as the chat template takes it (with its ``name`` unless told not to)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if name and self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_param(self) -> str:
        return "messages"


def parse_request(raw: bytes, model: type[_GenerationRequest],
                  max_stop: int = optspec.default("max_stop")) -> _GenerationRequest:
    """Validate a request body; every failure is an :class:`ApiError` naming the field.
    ``max_stop``: the stop strings a request may give (the server's ``--max-stop``)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None
    except RecursionError:  # the decoder recurses once per level of nesting
        raise ApiError(400, "the request body nests arrays or objects too deeply",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # cheap test first: only an escape can make one
        _refuse_surrogates(body)
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param_name(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "this field is required"
        elif err["type"] == "extra_forbidden" and len(err["loc"]) > 1 and err["loc"][0] in _NESTED_FIELDS:
            msg = f"unknown field; {_NESTED_FIELDS[err['loc'][0]]}"
        elif err["type"] == "extra_forbidden":
            msg = "unknown field: not an OpenAI request field nsd implements (nsd's own " \
                  "settings go in the \"nsd\" object)"
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param,
                       code="missing_field" if err["type"] == "missing" else "invalid_value") from None
    if len(request.stop or ()) > max_stop:
        raise ApiError(400, f"stop: at most {max_stop} stop strings are allowed, got "
                       f"{len(request.stop)} (OpenAI allows 4; the server's "
                       f"{optspec.SERVING['max_stop'].flag} sets the limit)", param="stop",
                       code="invalid_value")
    if request.n not in (None, 1):
        raise ApiError(400, f"n: only n = 1 is supported (one sequence per request), got {request.n}",
                       param="n", code="invalid_value")
    if isinstance(request, ChatRequest) and request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "top_logprobs: needs \"logprobs\": true", param="top_logprobs",
                       code="invalid_value")
    return request


# The objects inside a request, and the fields each takes (for an unknown field's message).
_NESTED_FIELDS = {
    "nsd": f"nsd takes {', '.join(NsdOptions.model_fields)}",
    "messages": f"a message takes {', '.join(ChatMessage.model_fields)}",
    "stream_options": f"stream_options takes {', '.join(StreamOptions.model_fields)}",
}


def _refuse_surrogates(body: Any) -> None:
    """Raise a 400 naming a string (or key) holding a lone UTF-16 surrogate."""
    # Iterative: the body may nest as deeply as the JSON decoder allowed.
    todo: list[tuple[tuple[Any, ...], Any]] = [((), body)]
    while todo:
        loc, value = todo.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                param = _param_name(loc)
                where = f"{param}: " if param else ""
                raise ApiError(400, f"{where}the text holds a lone UTF-16 surrogate (an unpaired "
                               "\\ud800-\\udfff escape), which is not valid Unicode",
                               param=param, code="invalid_value")
        elif isinstance(value, dict):
            for key, item in value.items():
                todo.extend([(loc, key), ((*loc, key), item)])
        elif isinstance(value, list):
            todo.extend(((*loc, i), item) for i, item in enumerate(value))


def _param_name(loc: tuple[Any, ...]) -> str | None:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def generation_config(request: _GenerationRequest, defaults: GenerationConfig,
                      max_new_tokens: int,
                      check: Callable[[GenerationConfig], None] | None = None,
                      proposer: str | None = None) -> GenerationConfig:
    """The request's settings over the server's defaults, validated by the library itself
    and then by ``check`` (what the engine can run); each failure is a 400 naming the field.
    ``proposer``: the server's (None: not known), against which draft-model-only fields of
    the ``nsd`` object are checked."""
    overrides: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                 "frequency_penalty"):
        if getattr(request, name) is not None:
            overrides[name] = getattr(request, name)
    if request.stop:
        overrides["stop"] = request.stop
    if request.logit_bias:
        overrides["logit_bias"] = request.logit_bias_pairs
    if request.top_logprobs_asked is not None:
        overrides["logprobs"] = request.top_logprobs_asked
    if request.nsd is not None:
        overrides.update(request.nsd.model_dump(exclude_none=True))
    try:
        config = dataclasses.replace(defaults, **overrides)  # validated whole on construction
        if request.nsd is not None:
            _check_applies(request.nsd.model_dump(exclude_none=True), config, proposer)
        if check is not None:
            check(config)
    except (NSDError, TypeError, ValueError) as exc:
        message = str(exc)
        # Name the field the library's message mentions first ("k_max (3) must be >= k (6)").
        hits = [(m.start(), n) for n in overrides
                if (m := re.search(rf"\b{re.escape(n)}\b", message)) is not None]
        name = min(hits)[1] if hits else None
        param = f"nsd.{name}" if name and request.nsd and name in request.nsd.model_fields_set else name
        raise ApiError(400, message, param=param, code="invalid_value") from None
    return config


def _check_applies(given: dict[str, Any], config: GenerationConfig, proposer: str | None = None) -> None:
    """A rule or draft-length field of the ``nsd`` object that acts on other methods than
    the request's (``theta`` with method ``sd``), ``k_max`` with a fixed k, or a field only a
    draft model reads on a server drafting by prompt lookup alone, would change nothing:
    refused, not ignored."""
    method = config.method
    for name, why in optspec.inert_options(given, [method], config.k, config.adaptive_k, proposer)[:1]:
        if why == "fixed_k":
            raise NSDError(f"k_max {given['k_max']!r} does nothing with a fixed k ({config.k}): it "
                           "bounds k auto and adaptive_k; leave it out or set k to auto")
        if why == "proposer":
            raise NSDError(f"{name} {given[name]!r} does nothing on this server: it drafts with "
                           f"the {proposer} proposer, and only a draft model reads {name}; leave it out")
        raise NSDError(f"{name} {given[name]!r} does nothing with method {method} (it acts on "
                       f"{', '.join(optspec.ALL[name].methods)}); leave it out or choose one of "
                       "those methods")


# ----------------------------------------------------------------------------- responses

def finish_reason(result: GenerationResult) -> str:
    return "length" if result.stats.stop_reason == "length" else "stop"


def usage(result: GenerationResult, config: GenerationConfig) -> dict[str, Any]:
    stats = result.stats
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
            # relaxed: whether the relaxed rule moved any position off the exact
            # distribution (D > 0); false: the text is exact SD's (at temperature 0, the
            # target's greedy text), so a client can tell without reading D.
            "nsd": {**stats.to_dict(), **method_report(config, stats.method),
                    "relaxed": stats.deviation > 0}}


class ResponseBuilder:
    """Bodies of one response (whole or streamed) in OpenAI's shapes."""

    def __init__(self, model: str, chat: bool, config: GenerationConfig) -> None:
        self.model, self.chat, self.config = model, chat, config
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, result: GenerationResult) -> dict[str, Any]:
        logprobs = None if result.logprobs is None else self.logprobs(result.logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": logprobs, "finish_reason": finish_reason(result)}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": result.text, "logprobs": logprobs,
                      "finish_reason": finish_reason(result)}
            body = self._base("text_completion")
        return {**body, "choices": [choice], "usage": self.usage(result)}

    def logprobs(self, infos: list[TokenInfo]) -> dict[str, Any]:
        """OpenAI's logprobs object: chat's ``content`` list, or the legacy completions form."""
        if self.chat:
            return {"content": [{"token": i.text, "logprob": _logprob(i.logprob),
                                 "bytes": list(i.text.encode()),
                                 "top_logprobs": [{"token": t, "logprob": _logprob(v),
                                                   "bytes": list(t.encode())} for _, t, v in i.top]}
                                for i in infos], "refusal": None}
        tops = []
        for i in infos:
            top: dict[str, float] = {}
            for _, t, v in i.top:  # distinct ids may share a text: the likelier one is kept
                top.setdefault(t, _logprob(v))
            tops.append(top)
        return {"tokens": [i.text for i in infos],
                "token_logprobs": [_logprob(i.logprob) for i in infos],
                "top_logprobs": tops, "text_offset": [i.offset for i in infos]}

    def usage(self, result: GenerationResult) -> dict[str, Any]:
        return usage(result, self.config)

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              usage_body: dict[str, Any] | None = None) -> dict[str, Any]:
        """One stream chunk: text (with its tokens' logprobs when the request asked for
        them), a finish reason, the chat role opener, or the usage."""
        infos = getattr(text, "logprobs", None)
        logprobs = None if infos is None else self.logprobs(infos)
        if self.chat:
            body = self._base("chat.completion.chunk")
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                ({} if text is None else {"content": str(text)})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            body = self._base("text_completion")
            choice = {"index": 0, "text": str(text or ""), "logprobs": logprobs,
                      "finish_reason": finish}
        if usage_body is not None:  # OpenAI's usage chunk has no choices
            return {**body, "choices": [], "usage": usage_body}
        return {**body, "choices": [choice], "usage": None}


# JSON has no -inf: a token the sampling filters removed gets OpenAI's floor value.
LOGPROB_FLOOR = -9999.0


def _logprob(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
