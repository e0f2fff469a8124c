"""A model's generation_config.json sampling defaults for requests that leave them out (vLLM's
--generation-config auto), the OpenAI defaults with `vllm`, and one-line errors for a bad file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from pagellm import generation_config as generation_defaults
from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.server.protocol_responses import ResponsesRequest

pytestmark = pytest.mark.timeout(240)


def _dir(tmp_path, config) -> str:
    (tmp_path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(tmp_path)


def test_fields_that_differ_from_the_openai_defaults_are_taken(tmp_path, smollm_gguf_path):
    folder = _dir(tmp_path, {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50,
                             "min_p": 0.0, "repetition_penalty": 1.0, "max_new_tokens": 30})
    assert generation_defaults.load("auto", folder) == {"temperature": 0.6, "top_p": 0.9, "top_k": 50}
    assert generation_defaults.load(folder, "/elsewhere") == {"temperature": 0.6, "top_p": 0.9, "top_k": 50}
    assert generation_defaults.load("vllm", folder) == {}
    assert generation_defaults.load("auto", smollm_gguf_path) == {}  # a GGUF file has no generation config
    assert generation_defaults.load("auto", str(tmp_path / "no-such-model")) == {}


@pytest.mark.parametrize("config, message", [
    ("{not json", "cannot read generation_config.json"),
    ("[1, 2]", "is not a JSON object"),
    ({"top_p": 5}, "top_p must be in (0, 1]"),
    ({"temperature": "hot"}, "temperature must be a number"),
])
def test_a_bad_file_is_one_line(tmp_path, config, message):
    with pytest.raises(ValueError) as e:
        generation_defaults.load("auto", _dir(tmp_path, config))
    assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("--generation-config")


def test_an_explicit_directory_must_hold_one(tmp_path):
    with pytest.raises(ValueError, match="cannot read generation_config.json"):
        generation_defaults.load(str(tmp_path), None)


def test_requests_take_the_defaults_only_for_fields_they_leave_out():
    defaults = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.1}
    p = CompletionRequest(prompt="x").to_sampling_params(4, None, defaults=defaults)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.top_p) == (0.0, 5, 1.1, 1.0)
    p = CompletionRequest(prompt="x", temperature=0.7, top_k=-1).to_sampling_params(4, None, defaults=defaults)
    assert (p.temperature, p.top_k, p.repetition_penalty) == (0.7, -1, 1.1)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.to_sampling_params(4, None, defaults=defaults).temperature == 0.0
    assert ResponsesRequest(input="hi").to_sampling_params(defaults).top_k == 5
    assert CompletionRequest(prompt="x").to_sampling_params(4, None).temperature == 1.0


def test_a_server_samples_at_the_models_defaults(tiny_hf_model, smollm_gguf_path, tmp_path):
    """A model directory whose generation_config.json says temperature 0: requests without a temperature are
    greedy (the same text as an explicit 0, every time); an explicit directory without the file is one line."""
    from test_server import Server

    model = tmp_path / "model"
    shutil.copytree(tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=512), model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    common = ["--model", str(model), "--tokenizer", smollm_gguf_path, "--kv-cache-memory", "16MiB"]
    server = Server(common, tmp_path / "a.log")
    try:
        client = server.client()
        greedy = client.completions.create(model=str(model), prompt="Hello", max_tokens=12, temperature=0)
        plain = [client.completions.create(model=str(model), prompt="Hello", max_tokens=12) for _ in range(2)]
        assert [c.choices[0].text for c in plain] == [greedy.choices[0].text] * 2
        assert "sampling defaults from generation_config.json" in server.output()
    finally:
        server.stop()
    proc = subprocess.run([sys.executable, "-m", "pagellm.cli", "serve", *common, "--generation-config",
                           str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--generation-config" in proc.stderr and "Traceback" not in proc.stderr


def test_llm_without_sampling_params_takes_the_models_defaults(tiny_hf_model, smollm_gguf_path, tmp_path):
    """vLLM's LLM.get_default_sampling_params: generate and chat given no params sample at the generation
    config's values (temperature 0 here: the explicit greedy text every time); "vllm" keeps SamplingParams()'s;
    explicit params are used as they are; a missing directory is one line before anything loads."""
    from pagellm import LLM, SamplingParams

    model = tmp_path / "model"
    shutil.copytree(tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=512), model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 7}))
    common = {"tokenizer": smollm_gguf_path, "kv_cache_memory": "16MiB"}
    llm = LLM(str(model), **common)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 7, 1.0)
        want = llm.generate("Hello", SamplingParams(temperature=0), use_tqdm=False)[0].outputs[0].token_ids
        plain = [llm.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids for _ in range(2)]
        assert plain == [want] * 2 and want
        chat = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
        chat_greedy = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0), use_tqdm=False)
        assert chat[0].outputs[0].token_ids == chat_greedy[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    openai_defaults = LLM(str(model), generation_config="vllm", **common)
    try:
        assert openai_defaults.get_default_sampling_params().temperature == 1.0
    finally:
        openai_defaults.shutdown()
    with pytest.raises(ValueError, match="cannot read generation_config.json"):
        LLM(str(model), generation_config=str(tmp_path / "nowhere"), **common)
