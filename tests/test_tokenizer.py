"""Tokenizer vs transformers on the same files: GGUF vocab (byte-level and sentencepiece), HF dirs,
chat templates, and the incremental detokenizer's streaming guarantees."""

from __future__ import annotations

import json
import os
import unicodedata

import pytest

from pagellm.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " leading space and trailing space ",
    "numbers: 0 7 42 1234567 3.14159 -12,345.67e-8 2024-11-30",
    "whitespace   runs\t\ttabs\n\n\nnewlines \r\n crlf     end",
    "unicode: naïve café Ünïcödé ñ ß ø æ",
    "CJK: 你好，世界！日本語のテキスト 한국어",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "code:\ndef f(x):\n    return {'a': [x**2, x // 3]}  # comment\n\tif x != 0: pass",
    "it's they're we've I'm you'll he'd DON'T",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "mixed<|endoftext|>specials <|im_end|>",
    "\u200b zero width, combining e\u0301, math ∑∫√∞ ≤ ≥",
]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke.\nPlease."}],
]


@pytest.fixture(scope="module")
def tok(smollm_gguf_path) -> Tokenizer:
    return Tokenizer.from_path(smollm_gguf_path)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_decode_matches_transformers(tok, hf_gguf_tokenizer, text):
    hf = hf_gguf_tokenizer
    for special in (True, False):
        ids = tok.encode(text, add_special_tokens=special)
        assert ids == hf.encode(text, add_special_tokens=special)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_gguf_special_tokens(tok, hf_gguf_tokenizer):
    hf = hf_gguf_tokenizer
    assert tok.vocab_size == len(hf) == 49152
    assert (tok.bos_token, tok.bos_token_id) == (hf.bos_token, hf.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == (hf.eos_token, hf.eos_token_id) == ("<|im_end|>", 2)
    assert tok.eos_token_ids == {2}
    assert tok.encode("<|im_end|>") == [2]  # special tokens in text stay whole
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # SmolLM2 adds no BOS
    assert tok.convert_ids_to_tokens(1) == "<|im_start|>"


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tok, hf_gguf_tokenizer, messages, gen):
    expected = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_chat_template_text_parts_are_flattened(tok):
    plain = [{"role": "user", "content": "Hello there"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_template_sandbox_and_helpers(tok):
    t = Tokenizer(tok.backend, special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
                  chat_template="{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}"
                                "{% if tools %}{{ raise_exception('no tools') }}{% endif %}")
    assert t.apply_chat_template([{"role": "user", "content": "<é>"}]) == \
        '<|im_start|>{"role": "user", "content": "<é>"}'
    with pytest.raises(Exception, match="no tools"):
        t.apply_chat_template([], tools=[{"type": "function"}])
    tagged = Tokenizer(tok.backend, special_tokens={}, chat_template=(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"))
    assert tagged.apply_chat_template([{"content": "a"}, {"content": "b"}]) == "[a]"
    evil = Tokenizer(tok.backend, special_tokens={}, chat_template="{{ ''.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        evil.apply_chat_template([])


def test_no_chat_template_raises(tok):
    bare = Tokenizer(tok.backend, special_tokens={}, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_directory_matches_transformers(tmp_path, hf_gguf_tokenizer):
    hf = hf_gguf_tokenizer
    hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ours = Tokenizer.from_path(str(tmp_path))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)
    assert ours.apply_chat_template(CHATS[2]) == hf.apply_chat_template(
        CHATS[2], tokenize=False, add_generation_prompt=True)
    assert ours.eos_token_ids == {2, 0}
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)


def test_hf_directory_add_bos_flag(tmp_path, hf_gguf_tokenizer):
    hf_gguf_tokenizer.save_pretrained(tmp_path)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg))
    ours = Tokenizer.from_path(str(tmp_path))
    assert ours.encode("hi") == [ours.bos_token_id] + ours.encode("hi", add_special_tokens=False)


def test_missing_tokenizer_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Tokenizer.from_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_path(str(tmp_path))


# -- GGUF vocabularies other than SmolLM2's, checked against transformers' GGUF converter -----------------


def _write_tokenizer_gguf(path, tokens, types, *, model, pre=None, merges=None, scores=None, add_bos=None):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _hf_from_gguf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, smollm_gguf_path, pre):
    from pagellm.model.loader.gguf_reader import GGUFFile

    # SmolLM2's vocab cut to its first 8000 tokens (and the merges among them) keeps transformers fast.
    md = GGUFFile(smollm_gguf_path).metadata
    tokens = md["tokenizer.ggml.tokens"][:8000]
    vocab = set(tokens)
    merges = [m for m in md["tokenizer.ggml.merges"]
              if all(p in vocab for p in m.split(" ")) and m.replace(" ", "") in vocab]
    path = _write_tokenizer_gguf(tmp_path / f"{pre}.gguf", tokens, md["tokenizer.ggml.token_type"][:8000],
                                 model="gpt2", pre=pre, merges=merges, add_bos=True)
    ours, hf = Tokenizer.from_path(path), _hf_from_gguf(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids[0] == 1  # add_bos_token=True
        # Qwen2's own tokenizer.json NFC-normalizes (we follow it); transformers' GGUF converter does not.
        assert ids == hf.encode(unicodedata.normalize("NFC", text) if pre == "qwen2" else text), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def _spm_vocab(smollm_tokens, n=3000):
    """A sentencepiece-style vocab: <unk> <s> </s>, 256 byte tokens, then SmolLM2 word pieces in `▁` form."""
    from pagellm.tokenizer import _bytes_to_unicode

    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    seen = set(tokens)
    for t in smollm_tokens[17:]:
        try:
            text = bytes(byte_of[c] for c in t).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        piece = text.replace(" ", "▁")
        if piece and piece not in seen and "\n" not in piece:
            seen.add(piece)
            tokens.append(piece)
            types.append(1)
        if len(tokens) >= n:
            break
    return tokens, types, [0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(len(tokens) - 259)]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory, smollm_gguf_path) -> str:
    from pagellm.model.loader.gguf_reader import GGUFFile

    tokens, types, scores = _spm_vocab(GGUFFile(smollm_gguf_path).metadata["tokenizer.ggml.tokens"])
    return _write_tokenizer_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", tokens, types, model="llama",
                                 scores=scores)


def test_sentencepiece_gguf_matches_transformers(spm_gguf):
    ours, hf = Tokenizer.from_path(spm_gguf), _hf_from_gguf(spm_gguf)
    # transformers' Metaspace differs from sentencepiece / llama.cpp (which we follow) in two places: it
    # adds no prefix space after a special token, nor to text that already starts with a space.
    for text in [t for t in TEXTS if "<|" not in t and t and not t.startswith(" ")]:
        ids = ours.encode(text)
        assert ids[0] == 1  # sentencepiece GGUFs add BOS unless told otherwise
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.convert_ids_to_tokens(ours.encode(" x", add_special_tokens=False)) == ["▁▁", "x"]


# -- incremental detokenizer -------------------------------------------------------------------------------

STREAM_TEXTS = [
    "Emoji 😀🎉👍🏽 and family 👨‍👩‍👧‍👦, flags 🇯🇵🇫🇷.",
    "中文字符和日本語のテキスト、한국어도 섞여 있습니다。",
    "plain ascii then ü ß ñ then 🤖 robots\n\nand code `x = y`",
    "<|im_start|>assistant\nspecial 🦀 tokens<|im_end|>",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_one_token_at_a_time(tok, text, skip):
    prompt = tok.encode("User said: 🎉 ok")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.step([i]) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert len(detok._ids) < 16  # the decode window stays small: O(new tokens) per step


def test_incremental_detokenizer_holds_back_partial_characters(tok):
    ids = tok.encode("🦀")
    assert len(ids) > 1, "needs an emoji split over several byte tokens"
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == "🦀"


def test_incremental_detokenizer_multi_token_steps(tok):
    ids = tok.encode(STREAM_TEXTS[0] + STREAM_TEXTS[1])
    detok = IncrementalDetokenizer(tok, [])
    out = [detok.step(ids[i:i + 3]) for i in range(0, len(ids), 3)]
    assert "".join(out) == tok.decode(ids)
    assert not any("\ufffd" in d for d in out)


def test_incremental_detokenizer_sentencepiece_spaces(spm_gguf):
    # The sentencepiece decoder strips the first leading space of every decode call; the detokenizer's
    # window must keep the space of a continuation token ("▁world" after a prompt is " world").
    tok = Tokenizer.from_path(spm_gguf)
    prompt = tok.encode("Say hello:")
    ids = tok.encode("Hello world 😀 again, 你好", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step([i]) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert "".join(deltas).startswith(" Hello")
    fresh = IncrementalDetokenizer(tok, [])
    assert "".join(fresh.step([i]) for i in ids) == tok.decode(ids)


@pytest.mark.parametrize("vocab", ["byte-level", "sentencepiece"])
@pytest.mark.parametrize("text", STREAM_TEXTS[:3])
def test_token_bytes_join_into_the_text(tok, spm_gguf, vocab, text):
    """A token that is a piece of a multi-byte character decodes alone to U+FFFD; its bytes (OpenAI's logprobs
    `bytes`) are the piece itself, so a client joining them gets the text back."""
    t = tok if vocab == "byte-level" else Tokenizer.from_path(spm_gguf)
    ids = t.encode(text, add_special_tokens=False)
    assert any("\ufffd" in t.decode([i]) for i in ids)  # some pieces are not whole characters
    assert b"".join(t.token_bytes(i) for i in ids).decode() == (text if vocab == "byte-level" else " " + text)
