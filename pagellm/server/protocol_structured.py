"""Structured-output request fields (OpenAI's response_format, vLLM's guided_* and structured_outputs) ->
StructuredOutputsParams, and their compilation before admission.

Every form a client may send is honoured or refused: more than one form at once, an unknown backend or
an unknown key is a 400 naming it, never a silently unconstrained answer. Errors name the field the
client used (guided_json, response_format, structured_outputs.regex, ...), not pagellm's internal one.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.server.errors import APIError, bad_request
from pagellm.server.fields import Flag

FIELD_KEY = "structured_outputs_field"  # SamplingParams.extra: the request field the spec came from
_BACKENDS = ("auto", "xgrammar")
# xgrammar's whitespace between JSON tokens when any whitespace is asked for.
_ANY_WHITESPACE = r"[ \n\t]*"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Flag | None = None  # pagellm always enforces the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs` object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: Flag | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: Flag | None = None  # pagellm's default; False allows any whitespace
    disable_fallback: Flag | None = None  # there is no fallback backend: accepted, nothing to disable


class StructuredOutputFields(BaseModel):
    """Mixed into the completions and chat request bodies."""

    model_config = ConfigDict(extra="ignore")

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: StructuredOutputsBody | None = None

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the spec, the request field it came from); (None, None) when the output is unconstrained.
        ValueError (naming the fields) for conflicting or incomplete forms."""
        if self.guided_decoding_backend not in (None, *_BACKENDS):
            raise ValueError(f"guided_decoding_backend must be one of {', '.join(_BACKENDS)} (pagellm's "
                             f"structured output uses xgrammar), got {self.guided_decoding_backend!r}")
        forms = self._forms()
        if len(forms) > 1:
            roots = [name.split(".")[0] for name, _ in forms]
            raise ValueError(f"{roots[0]} must not be combined with {' or '.join(roots[1:])}: give one way to "
                             f"constrain the output")
        if not forms:
            if self.guided_whitespace_pattern is not None:
                raise ValueError("guided_whitespace_pattern requires guided_json or a JSON response_format")
            return None, None
        (field, build), = forms
        return build(), field

    def _forms(self) -> list[tuple[str, Any]]:
        ws = self.guided_whitespace_pattern
        forms: list[tuple[str, Any]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            forms.append(("response_format", lambda: StructuredOutputsParams(json_object=True, whitespace_pattern=ws)))
        elif rf is not None and rf.type == "json_schema":
            forms.append(("response_format.json_schema.schema", lambda: _json_schema_params(rf, ws)))
        if self.guided_json is not None:
            forms.append(("guided_json", lambda: StructuredOutputsParams(json=self.guided_json, whitespace_pattern=ws)))
        for name in ("guided_regex", "guided_grammar"):
            if getattr(self, name) == "":  # else "exactly one of ... got none", naming the wrong field
                raise ValueError(f"{name} must be a non-empty string")
        if self.guided_regex is not None:
            forms.append(("guided_regex", lambda: StructuredOutputsParams(regex=self.guided_regex)))
        if self.guided_choice is not None:
            if not self.guided_choice:
                raise ValueError("guided_choice must be a non-empty list of strings")
            forms.append(("guided_choice", lambda: StructuredOutputsParams(choice=self.guided_choice)))
        if self.guided_grammar is not None:
            forms.append(("guided_grammar", lambda: StructuredOutputsParams(grammar=self.guided_grammar)))
        so = self.structured_outputs
        if so is not None:
            kinds = [k for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object))
                     if v is not None and v is not False]  # {"json": {}} is a schema: any JSON value
            if len(kinds) != 1 or (so.choice is not None and not so.choice):
                raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar or "
                                 f"json_object, got {', '.join(kinds) or 'none'}")
            forms.append((f"structured_outputs.{kinds[0]}", lambda: _vllm_params(so, kinds[0])))
        return forms


def _json_schema_params(rf: ResponseFormat, ws: str | None) -> StructuredOutputsParams:
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise ValueError("response_format requires json_schema.schema (the JSON schema) with type json_schema")
    return StructuredOutputsParams(json=rf.json_schema.schema_, whitespace_pattern=ws)


def _vllm_params(so: StructuredOutputsBody, kind: str) -> StructuredOutputsParams:
    ws = so.whitespace_pattern
    if so.disable_any_whitespace is False:
        if ws is not None:
            raise ValueError("structured_outputs must give whitespace_pattern or disable_any_whitespace=false, "
                             "not both")
        ws = _ANY_WHITESPACE
    value = {"json": so.json_, "json_object": True}.get(kind, getattr(so, kind))
    return StructuredOutputsParams(**{kind: value}, whitespace_pattern=ws)


def attach(params: SamplingParams, spec: StructuredOutputsParams | None, field: str | None) -> SamplingParams:
    """Set the spec on params, remembering the field it came from for error messages."""
    if spec is not None:
        params.structured_outputs = spec
        params.extra[FIELD_KEY] = field
    return params


# Grammars compile in their own threads, not asyncio's default pool, which tokenizes prompts and renders chat
# templates: a burst of big grammars (a compile cannot be stopped) must not stall every other request's
# admission. A compile still queued when its request is cancelled is dropped.
_COMPILE_POOL = ThreadPoolExecutor(2, thread_name_prefix="pagellm-grammar")


async def compile_structured_outputs(engine, params: SamplingParams) -> None:
    """Validate and compile a request's grammar in a worker thread, before admission: an invalid spec is a
    400 naming its field. `engine` is the async engine (engine/engine_front.py)."""
    if params.structured_outputs is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(_COMPILE_POOL, engine.structured_output.validate, params)
    except ValueError as e:
        raise structured_error(e, params) from None


def structured_error(e: ValueError, params: SamplingParams) -> APIError:
    msg = str(e)
    internal = f"structured_outputs.{params.structured_outputs.kind}"
    field = params.extra.get(FIELD_KEY) or internal
    if msg.startswith(internal + ":"):
        msg = field + msg[len(internal):]
        return APIError(400, msg, param=field.split(".")[0])
    return bad_request(msg)
