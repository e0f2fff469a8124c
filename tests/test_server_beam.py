"""Beam search over HTTP with vLLM's extra fields (use_beam_search, length_penalty, best_of), checked
against LLM.generate's beam output on the same tiny random Llama."""

import httpx
import pytest

# test_server's module-scoped fixtures, imported: this module gets its own tiny-model server and LLM.
from test_server import MODEL, client, llm, server, tiny_path  # noqa: F401

from pagellm import SamplingParams


def beams(llm, prompt, n, width, length_penalty=1.0, max_tokens=8, chat=False):
    params = SamplingParams(n=n, use_beam_search=True, beam_width=width, length_penalty=length_penalty,
                            max_tokens=max_tokens, temperature=0.0)
    if chat:
        return llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0].outputs
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs


def texts(choices):
    return [(c.text, c.finish_reason) for c in choices]


def test_completion_beams_equal_llm_generate(client, llm):
    prompts = ["The quick brown fox", "Once upon a time"]
    # best_of is the beam width; n of the beams come back, best first.
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, best_of=4, max_tokens=8,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    expected = [beams(llm, p, 2, 4, 0.5) for p in prompts]
    assert texts(r.choices) == [(c.text, c.finish_reason) for outs in expected for c in outs]
    assert r.usage.completion_tokens == sum(len(c.token_ids) for outs in expected for c in outs)
    # Without best_of the beam width is n.
    r = client.completions.create(model=MODEL, prompt=prompts[0], n=3, max_tokens=8,
                                  extra_body={"use_beam_search": True})
    assert texts(r.choices) == texts(beams(llm, prompts[0], 3, 3))


def test_chat_beams_equal_llm_chat(client, llm):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                       n=2, max_tokens=8, extra_body={"use_beam_search": True,
                                                                      "length_penalty": 2.0})
    expected = beams(llm, "Name a color.", 2, 2, 2.0, chat=True)
    assert [(c.message.content, c.finish_reason) for c in r.choices] == texts(expected)
    assert [c.index for c in r.choices] == [0, 1]


def test_chat_beams_without_max_tokens_run_to_the_context_limit(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True,
            "n": 1, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()
    assert r["usage"]["total_tokens"] == 1024 and r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/completions", {"stream": True}, "stream"),
    ("/v1/chat/completions", {"stream": True}, "stream"),
    ("/v1/completions", {"n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"temperature": 0.7}, "temperature"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"stop": ["."]}, "stop"),
    ("/v1/completions", {"max_tokens": None}, "max_tokens"),
])
def test_beam_search_refuses_what_it_cannot_honour(server, path, extra, param):
    body = {"model": MODEL, "use_beam_search": True, "max_tokens": 4, **extra}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert ("use_beam_search" if param != "max_tokens" else "beam search") in err["message"]


def test_best_of_without_beam_search_is_still_refused(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 1, "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_a_beam_wider_than_max_num_seqs_names_the_field_the_client_sent(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "use_beam_search": True}
    r = httpx.post(server.url + "/v1/completions", json={**body, "n": 1, "best_of": 100}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text
    assert "beam_width must be <= max_num_seqs" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "use_beam_search": True,
        "n": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
