"""The OpenAI chat completions protocol as pydantic models: the request the server accepts, the bodies it answers,
and the translation of a validation failure into OpenAI's error JSON.

FastAPI validates a request body against ChatCompletionRequest before the handler runs and publishes the schema
at /openapi.json. A failure is answered as OpenAI does, 400 with {"error": {"message", "type", "param", "code"}},
and the message is one line that names the field, the value sent and what it must be (explain_validation_error).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from ..tokenizer import ROLES

Role = Literal[tuple(ROLES)]  # type: ignore[valid-type]


def _must_be(requirement: str):
    """Any failure of the wrapped type becomes one error, '<param> must be <requirement>' (the parts of a union
    would otherwise each report their own failure)."""

    def validate(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("kvbook_shape", "must be " + requirement) from None

    return WrapValidator(validate)


def _non_empty_list(requirement: str):
    """Not a non-empty list: '<param> must be <requirement>'; a list: its items report their own errors."""

    def validate(value, handler):
        if not isinstance(value, list) or not value:
            raise PydanticCustomError("kvbook_shape", "must be " + requirement)
        return handler(value)

    return WrapValidator(validate)


def _text_only(value, handler):
    try:
        return handler(value)
    except ValidationError:
        if isinstance(value, list) and value:
            for part in value:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise PydanticCustomError("kvbook_content", "only text parts are supported, got {kind}",
                                              {"kind": repr(kind)}) from None
        raise PydanticCustomError("kvbook_shape", "must be a string or a non-empty list of text parts") from None


class TextPart(BaseModel):
    """One part of OpenAI's list-of-parts content; only text parts are served."""

    type: Literal["text"]
    text: Annotated[str, Field(strict=True)]


class ChatMessage(BaseModel):
    role: Role = Field(description="who speaks: " + ", ".join(ROLES))
    content: Annotated[str | Annotated[list[TextPart], Field(min_length=1)], WrapValidator(_text_only)] = Field(
        description="the text, or OpenAI's list of text parts (joined)")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: Annotated[bool, Field(strict=True)] = False


StopString = Annotated[str, Field(min_length=1)]
MESSAGES = "a non-empty list of {role, content} objects"
REQUIRED_FIELDS = {"model": "the served model's name, as GET /v1/models lists it", "messages": MESSAGES}


class ChatCompletionRequest(BaseModel):
    """The body of POST .../v1/chat/completions. Unknown keys are ignored, as OpenAI-compatible servers do."""

    model: str = Field(description="the served model's name ([model] name); another name is a 404")
    messages: Annotated[list[ChatMessage], Field(min_length=1),
                        _non_empty_list(MESSAGES)]
    max_tokens: Annotated[int | None, Field(strict=True, ge=1)] = Field(
        None, description="new tokens at most (default: [inference] output_len)")
    max_completion_tokens: Annotated[int | None, Field(strict=True, ge=1)] = Field(
        None, description="OpenAI's newer name for max_tokens; wins when both are sent")
    temperature: Annotated[float | None, Field(strict=True, ge=0, le=2)] = Field(
        None, description="0 = greedy (default 1)")
    top_p: Annotated[float | None, Field(strict=True, gt=0, le=1)] = Field(
        None, description="nucleus sampling (default 1)")
    top_k: Annotated[int | None, Field(strict=True, ge=0)] = Field(
        None, description="vLLM's extension: draw from the k most likely tokens only (default 0: every token)")
    seed: Annotated[int | None, Field(strict=True, ge=-2**63, le=2**63 - 1)] = Field(
        None, description="seed of this request's sampler (a 64-bit integer)")
    stop: Annotated[StopString | Annotated[list[StopString], Field(max_length=4)] | None,
                    _must_be("a non-empty string or a list of up to 4 of them")] = None
    stream: Annotated[bool | None, Field(strict=True)] = False
    stream_options: Annotated[StreamOptions | None, _must_be("an object like {\"include_usage\": true}")] = None
    ignore_eos: Annotated[bool | None, Field(strict=True)] = Field(
        False, description="vLLM's extension: always produce max_tokens tokens")
    n: Annotated[int | None, Field(strict=True, ge=1, le=1)] = Field(
        None, description="choices per request: one is served (a client asking for more gets a 400, not fewer)")

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# -- answers --

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt positions taken from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


FinishReason = Literal["stop", "length"]


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed answer; the stream ends with `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvbook"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- validation errors in OpenAI's words --

_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
               "list": "a list", "dict": "an object", "model": "an object"}
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple) -> str:
    """('body', 'messages', 0, 'content') -> 'messages[0].content' (union-member tags left out)."""
    text = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            text += f"[{part}]"
        elif i == 0 and part == "body":
            continue
        elif part in _UNION_TAGS or "[" in part or part[:1].isupper() or part.startswith("function-"):
            continue  # pydantic names the member of a union it tried: 'str', 'list[TextPart]', 'StreamOptions'
        else:
            text += ("." if text else "") + part
    return text


def explain_validation_error(error: dict[str, Any], content_type: str = "application/json") -> tuple[str, str | None]:
    """One pydantic error (from RequestValidationError.errors()) -> (message, param), as clear as a hand-written
    check: the field, the value that was sent, and what it must be."""
    kind, loc, value, ctx = error["type"], tuple(error.get("loc", ())), error.get("input"), error.get("ctx") or {}
    param = _param(loc)
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {ctx.get('error', error.get('msg'))}", None
    if not param and "json" not in content_type:
        return f"the request body must be JSON sent with Content-Type: application/json, not {content_type!r}", None
    if not param:
        return "the request body must be a JSON object with model and messages", None
    if kind == "missing":
        hint = REQUIRED_FIELDS.get(param)
        return f"{param} is required" + (f": {hint}" if hint else ""), param
    if kind.startswith("kvbook_"):
        separator = ": " if kind == "kvbook_content" else " "
        return f"{param}{separator}{error['msg']}", param
    if kind in ("greater_than_equal", "greater_than"):
        bound = ctx.get("ge", ctx.get("gt"))
        return f"{param} = {value!r} is too small: must be {'>=' if kind.endswith('equal') else '>'} {bound}", param
    if kind in ("less_than_equal", "less_than"):
        bound = ctx.get("le", ctx.get("lt"))
        return f"{param} = {value!r} is too large: must be {'<=' if kind.endswith('equal') else '<'} {bound}", param
    if kind == "literal_error":
        return f"{param} = {value!r}: use one of {ctx.get('expected')}", param
    expected = kind.split("_")[0]
    if kind.endswith("_type") or kind.endswith("_parsing") or kind.startswith("int_from"):
        return f"{param} must be {_TYPE_NAMES.get(expected, expected)}, got {value!r}", param
    return f"{param}: {error['msg']} (got {value!r})", param
