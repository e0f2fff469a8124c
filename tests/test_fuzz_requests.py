"""hypothesis over the request bodies, SamplingParams, chat messages and chat templates, and template
injection against the jinja sandbox (in process and through a real server's --chat-template, a request's
chat_template and chat_template_kwargs, and message content)."""

from __future__ import annotations

import math
import os

import httpx
import jinja2
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_server import Server

from pagellm.chat_template import render_messages
from pagellm.sampling_params import SamplingParams
from pagellm.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest

pytestmark = pytest.mark.timeout(240)

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

SECRET_ENV = "PAGELLM_FUZZ_SECRET"
SECRET_ENV_VALUE = "env-secret-5f1c9a"
SECRET_FILE_VALUE = "file-secret-77e0b2"
# What a leaked Python object or module would print; none of it may come out of a template.
LEAK_MARKERS = ("<module", "<class", "<Context", "<built-in", "environ({", "<function")

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.sampled_from([0, -1, 1, 2**31, 2**63])
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _body(model_cls, required: dict):
    names = sorted(model_cls.model_fields)
    return st.fixed_dictionaries(required, optional={n: JSON for n in names if n not in required}) | st.dictionaries(
        st.sampled_from(names) | st.text(max_size=10), JSON, max_size=6)


def _message():
    role = st.sampled_from(["system", "developer", "user", "assistant", "tool"]) | st.text(max_size=6)
    return st.fixed_dictionaries({"role": role}, optional={"content": JSON | st.text(max_size=40),
                                                           "name": JSON, "tool_calls": JSON,
                                                           "tool_call_id": JSON})


@FUZZ
@given(raw=_body(CompletionRequest, {"prompt": JSON}))
def test_completion_body_validates_or_raises_value_error(raw):
    try:
        body = CompletionRequest.model_validate(raw)
        body.prompts()
        params = body.to_sampling_params(body.max_tokens, body.logprobs, beam_width=body.best_of)
    except ValueError:  # pydantic's ValidationError too: the server answers 400 for both
        return
    assert isinstance(params, SamplingParams)


@FUZZ
@given(raw=_body(ChatCompletionRequest, {"messages": st.lists(_message(), max_size=3)}))
def test_chat_body_validates_or_raises_value_error(raw):
    try:
        body = ChatCompletionRequest.model_validate(raw)
        params = body.to_sampling_params(body.max_tokens, body.engine_logprobs)
        [m.to_template_dict() for m in body.messages]
    except ValueError:
        return
    assert isinstance(params, SamplingParams)


# Scalars: any JSON value. Sequences and maps: their element values are fuzzed (a non-list there is a
# caller's type error, which Python itself reports).
_SEQ = st.none() | st.lists(JSON, max_size=4)
SAMPLING_FIELDS = {
    **{name: JSON for name in ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
                               "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                               "beam_width", "length_penalty", "prompt_logprobs", "truncate_prompt_tokens")},
    "stop": _SEQ | st.text(max_size=8), "stop_token_ids": _SEQ, "allowed_token_ids": _SEQ, "bad_words": _SEQ,
    "logit_bias": st.none() | st.dictionaries(JSON_SCALARS.filter(lambda k: isinstance(k, (int, str))), JSON,
                                              max_size=3),
}


@FUZZ
@given(data=st.data())
def test_sampling_params_error_names_the_field(data):
    field = data.draw(st.sampled_from(sorted(SAMPLING_FIELDS)))
    value = data.draw(SAMPLING_FIELDS[field])
    try:
        params = SamplingParams(**{field: value})
    except (ValueError, TypeError) as e:
        assert field in str(e), (field, value, str(e))
        return
    # What was accepted is usable: numbers are finite where the sampler does arithmetic with them.
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        v = getattr(params, name)
        assert v is None or math.isfinite(v), (name, v)


SMOL_TEMPLATE_SAMPLE = (  # the shape of SmolLM2's template: every content goes in verbatim
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

INJECTIONS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ self._TemplateReference__context }}",
    "{{ self.__dict__ }}",
    "{{ cycler.__init__.__globals__.os.environ }}",
    "{{ cycler.__init__.__globals__.os.popen('cat SECRET_FILE').read() }}",
    "{{ joiner.__init__.__globals__['os'].environ['" + SECRET_ENV + "'] }}",
    "{{ namespace.__init__.__globals__.os.environ }}",
    "{{ lipsum.__globals__['os'].environ }}",
    "{{ lipsum.__globals__.__builtins__.open('SECRET_FILE').read() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ messages[0]|attr('__class__')|attr('__init__')|attr('__globals__') }}",
    "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{% include 'SECRET_FILE' %}",
    "{% import 'SECRET_FILE' as x %}{{ x }}",
    "{% extends 'SECRET_FILE' %}",
    "{{ range(10**9)|list|length }}",
    "{{ messages.append(1) }}{{ messages[0].update({'role': 1}) }}",
    "{{ 1 / 0 }}",
    "{{ config }}{{ request }}{{ os }}{{ environ }}{{ self }}",
]


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "secret.txt"
    path.write_text(SECRET_FILE_VALUE)
    os.environ[SECRET_ENV] = SECRET_ENV_VALUE  # this process too, for the in-process renders
    yield str(path)
    os.environ.pop(SECRET_ENV, None)


def _assert_no_leak(text: str) -> None:
    assert SECRET_ENV_VALUE not in text and SECRET_FILE_VALUE not in text, text[:500]
    for marker in LEAK_MARKERS:
        assert marker not in text, (marker, text[:500])


@pytest.mark.parametrize("payload", INJECTIONS)
def test_template_injection_is_refused_or_renders_nothing(payload, secrets):
    source = payload.replace("SECRET_FILE", secrets)
    msgs = [{"role": "user", "content": "hi"}]
    try:
        out = render_messages(source, msgs, special_tokens={}, probe=source)
    except (jinja2.TemplateError, TypeError, ArithmeticError) as e:  # what the server answers 400 for
        _assert_no_leak(str(e))
        return
    _assert_no_leak(out.replace(source, ""))  # probe= renders the payload text itself, harmlessly
    assert msgs == [{"role": "user", "content": "hi"}]  # the sandbox is immutable


@FUZZ
@given(messages=st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=60)
                                                | st.sampled_from(INJECTIONS)}), min_size=1, max_size=4))
def test_message_content_is_data_never_template_code(messages, secrets):
    out = render_messages(SMOL_TEMPLATE_SAMPLE, messages, special_tokens={})
    pos = 0
    for m in messages:  # each content appears verbatim and in order: nothing in it was evaluated
        pos = out.index(m["content"], pos) + len(m["content"])
    assert SECRET_ENV_VALUE not in out and SECRET_FILE_VALUE not in out


@FUZZ
@given(raw=st.lists(_message(), max_size=4))
def test_chat_messages_validate_and_render_or_raise_value_error(raw):
    try:
        msgs = [ChatMessage.model_validate(m).to_template_dict() for m in raw]
        render_messages(SMOL_TEMPLATE_SAMPLE, msgs, special_tokens={})
    except (ValidationError, ValueError):
        return


# ---- the same through a real server ------------------------------------------------------------------

SERVER_TEMPLATE = (  # would print the context, a module's globals and a class if the sandbox failed
    "{{ self._TemplateReference__context }}{{ lipsum.__globals__ }}{{ messages[0]|attr('__class__') }}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    "{% if probe is defined %}[{{ probe }}]{% endif %}")


@pytest.fixture(scope="module")
def server(tiny_hf_model, smollm_gguf_path, tmp_path_factory, secrets):
    tmp = tmp_path_factory.mktemp("fuzz-req-srv")
    (tmp / "template.jinja").write_text(SERVER_TEMPLATE)
    os.environ[SECRET_ENV] = SECRET_ENV_VALUE  # inherited by the server process
    s = Server(["--model", tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024),
                "--tokenizer", smollm_gguf_path, "--served-model-name", "tiny", "--kv-cache-memory", "16MiB",
                "--chat-template", str(tmp / "template.jinja"), "--trust-request-chat-template"],
               tmp / "server.log")
    yield s
    s.stop()
    assert "Traceback" not in s.output(), s.output()[-3000:]


def _rendered(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/tokenize", json={"return_token_strs": True, **body}, timeout=30)


def _prompt_text(server, r: httpx.Response) -> str:
    tokens = r.json()["tokens"]
    return httpx.post(server.url + "/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]


def test_server_template_file_and_content_cannot_leak(server, secrets):
    content = "{{ 7 * 7 }} " + " ".join(INJECTIONS[:6]).replace("SECRET_FILE", secrets)
    r = _rendered(server, messages=[{"role": "user", "content": content}],
                  chat_template_kwargs={"probe": "{{ cycler.__init__.__globals__.os.environ }}"})
    assert r.status_code == 200, r.text
    text = _prompt_text(server, r)
    assert text.startswith("<user>" + content + "</user>"), text[:300]  # content verbatim, not evaluated
    assert "[{{ cycler.__init__.__globals__.os.environ }}]" in text  # kwargs are data too
    assert "49" not in text.replace(content, "")
    _assert_no_leak(text.replace(content, "").replace("{{ cycler.__init__.__globals__.os.environ }}", ""))


@pytest.mark.parametrize("payload", INJECTIONS)
def test_request_chat_template_injection_gets_200_without_secrets_or_400(server, secrets, payload):
    source = payload.replace("SECRET_FILE", secrets)
    r = _rendered(server, messages=[{"role": "user", "content": "hi"}], chat_template=source)
    if r.status_code == 200:
        _assert_no_leak(_prompt_text(server, r))
        return
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    _assert_no_leak(err["message"])


def test_openai_client_sees_a_400_for_a_refused_template(server, secrets):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"chat_template": INJECTIONS[0]})
    _assert_no_leak(str(e.value))
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": INJECTIONS[3]}],
                                        max_tokens=2, extra_body={"chat_template": SMOL_TEMPLATE_SAMPLE})
    assert ok.choices[0].finish_reason in ("length", "stop")
