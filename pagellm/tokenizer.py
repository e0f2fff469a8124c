"""Tokenizers from a Hugging Face directory or a GGUF's embedded vocabulary; streaming text.

Only `tokenizers` at runtime (no transformers: it costs seconds at start-up); chat templates are rendered
by `pagellm.chat_template`. The GGUF tokenizer is rebuilt the way llama.cpp tokenizes: byte-level BPE
with the split regex named by `tokenizer.ggml.pre`, or sentencepiece-style BPE with byte fallback.
"""

from __future__ import annotations

import json
import logging
import os
import re

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from pagellm.chat_template import render_messages

logger = logging.getLogger(__name__)
# Longer texts are encoded through encode_batch, which releases the GIL (see Tokenizer.encode).
_GIL_FREE_ENCODE_CHARS = 4096

# llama.cpp token_type values
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_GPT2_PRES = ("default", "gpt2", "gpt-2")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 bytes (what byte-level vocabularies are written in)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_BYTE_OF_SPELLING = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_backend(md: dict) -> BackendTokenizer:
    tokens, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens a converter stored as raw text (e.g. added tokens with spaces) are respelled in the alphabet.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    pre = md.get("tokenizer.ggml.pre", "default")
    # llama.cpp (like Llama 3's tokenizer.json) takes a whole pre-token that is in the vocab as is.
    backend = BackendTokenizer(BPE(vocab, merges, ignore_merges=pre in _SPLITS and "qwen" not in pre))
    if pre == "smollm":
        # SmolLM's own tokenizer.json: every digit on its own, then GPT-2's split.
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in _SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        if pre not in _GPT2_PRES:
            logger.warning("unknown GGUF pre-tokenizer %r; using GPT-2's split regex", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre.startswith("qwen") or pre == "deepseek-r1-qwen":
        backend.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    backend.decoder = decoders.ByteLevel()
    # A "control" token spelled outside the byte alphabet is a mislabel; adding it would grow the vocab.
    specials = [t for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL and set(t) <= alphabet]
    _add_tokens(backend, specials, [t for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED])
    return backend


def _sentencepiece_backend(md: dict) -> BackendTokenizer:
    tokens, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
    scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in md:
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    else:
        normal = {t: s for t, s, ty in zip(tokens, scores, types or [_NORMAL] * len(tokens), strict=False)
                  if ty == _NORMAL}
        merges = _merges_from_scores(vocab, normal)
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    backend = BackendTokenizer(BPE(vocab, merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                                   fuse_unk=True, byte_fallback=True))
    add_prefix = md.get("tokenizer.ggml.add_space_prefix", True)
    # llama.cpp prepends the space to every text fragment, also after a special token (legacy HF style).
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if add_prefix else []) + [normalizers.Replace(" ", "▁")])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix else []))
    _add_tokens(backend, [t for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL],
                [t for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED])
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Sentencepiece GGUFs carry no merges: a token's score ranks every split of it into two tokens."""
    ranked = []
    for token, score in scores.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked += [(score, left, right) for left, right in pairs]
    ranked.sort(key=lambda r: (r[0], len(r[1]), len(r[2])), reverse=True)
    return [(left, right) for _, left, right in ranked]


def _add_tokens(backend: BackendTokenizer, special: list[str], user_defined: list[str]) -> None:
    if special:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user_defined:
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])


def _set_bos_eos(backend: BackendTokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool):
    """Make encode(add_special_tokens=True) add BOS/EOS exactly as the flags say (as transformers does)."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = (f"{bos}:0 " if add_bos else "") + "$A:0" + (f" {eos}:0" if add_eos else "")
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    special = ([(bos, backend.token_to_id(bos))] if add_bos else []) + \
              ([(eos, backend.token_to_id(eos))] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return value


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _id_list(value) -> list[int]:
    return [value] if isinstance(value, int) else list(value or [])


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, *, special_tokens: dict[str, str | None],
                 eos_token_ids: list[int] = (), chat_template: str | dict[str, str] | None = None):
        self.backend = backend
        # bos_token / eos_token / unk_token / pad_token strings (also exposed to chat templates)
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = backend.token_to_id(self.eos_token) if self.eos_token else None
        ids = ([self.eos_token_id] if self.eos_token_id is not None else []) + list(eos_token_ids)
        self.eos_token_ids: set[int] = set(ids)
        self._templates = chat_template if isinstance(chat_template, dict) else (
            {"default": chat_template} if chat_template else {})
        self.chat_template: str | None = (self._templates.get("default")
                                          or next(iter(self._templates.values()), None))
        self._decoder_types: frozenset[str] | None = None  # decoder_kinds(), read once

    # -- construction -----------------------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str) -> Tokenizer:
        path = os.path.expanduser(str(path))
        if os.path.isdir(path):
            return cls._from_hf_dir(path)
        if os.path.isfile(path):
            from pagellm.model.loader.model_file_error import ModelFileError

            try:
                return cls._from_gguf(path)
            except ModelFileError:
                raise
            except Exception as e:  # untrusted metadata; the tokenizers library raises plain Exceptions
                raise ModelFileError(path, f"tokenizer metadata unusable: {type(e).__name__}: {e}") from None
        raise FileNotFoundError(f"tokenizer path {path!r} not found (expected a .gguf file or HF directory)")

    @classmethod
    def _from_gguf(cls, path: str) -> Tokenizer:
        from pagellm.model.loader.gguf_reader import GGUFFile

        md = GGUFFile(path).metadata
        kind = md.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend, default_bos = _byte_level_backend(md), False
        elif kind == "llama":
            # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
            backend, default_bos = _sentencepiece_backend(md), True
        else:
            raise ValueError(f"{path}: unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
        tokens = md["tokenizer.ggml.tokens"]
        names = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
        ids = {name: md.get(f"tokenizer.ggml.{key}_token_id") for name, key in names.items()}
        special = {name: tokens[i] if i is not None else None for name, i in ids.items()}
        _set_bos_eos(backend, special["bos_token"], special["eos_token"],
                     bool(md.get("tokenizer.ggml.add_bos_token", default_bos)),
                     bool(md.get("tokenizer.ggml.add_eos_token", False)))
        eos = [md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md]
        return cls(backend, special_tokens=special, eos_token_ids=eos,
                   chat_template=md.get("tokenizer.chat_template"))

    @classmethod
    def _from_hf_dir(cls, path: str) -> Tokenizer:
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"{path} has no tokenizer.json (slow sentencepiece-only tokenizers are "
                                    "not supported)")
        backend = BackendTokenizer.from_file(tok_file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
        special = {k: _token_str(cfg.get(k)) or _token_str(special_map.get(k))
                   for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        if "add_bos_token" in cfg or "add_eos_token" in cfg:
            _set_bos_eos(backend, special["bos_token"], special["eos_token"],
                         bool(cfg.get("add_bos_token")), bool(cfg.get("add_eos_token")))
        eos_ids = _id_list(_read_json(os.path.join(path, "generation_config.json")).get("eos_token_id"))
        return cls(backend, special_tokens=special, eos_token_ids=eos_ids,
                   chat_template=_hf_template(path, cfg))

    # -- encoding -----------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            if len(text) > _GIL_FREE_ENCODE_CHARS:
                # tokenizers' encode holds the GIL throughout (~3 ms per 1k tokens), encode_batch releases it:
                # a long prompt encoded in a worker thread must not stall the server's event loop.
                return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # "TextInputSequence must be str": a lone surrogate (an argv byte that is not UTF-8)
            bad = next((i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF), None)
            if bad is None:
                raise
            raise ValueError(f"the text is not valid Unicode at character {bad} (U+{ord(text[bad]):04X}, a lone "
                             "surrogate: bytes that are not UTF-8, or half of a UTF-16 pair)") from None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also when they are a piece of a multi-byte character (which
        decoding the token alone turns into U+FFFD): byte-level BPE's GPT-2 spelling of bytes, sentencepiece's
        <0xNN> byte tokens and "▁" spaces; else (added tokens, other vocabularies) the decoded text."""
        token = self.backend.id_to_token(token_id) or ""
        decoder = self.decoder_kinds()
        if "ByteLevel" in decoder and token and all(c in _BYTE_OF_SPELLING for c in token):
            return bytes(_BYTE_OF_SPELLING[c] for c in token)
        if "ByteFallback" in decoder:
            byte = _BYTE_TOKEN.fullmatch(token)
            if byte:
                return bytes([int(byte.group(1), 16)])
            if "\u2581" in token:
                return token.replace("\u2581", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    def decoder_kinds(self) -> frozenset[str]:
        """The decoder's step types ("ByteLevel": GPT-2's byte spelling; "ByteFallback": sentencepiece's
        <0xNN> tokens), read once."""
        kinds = self._decoder_types
        if kinds is None:
            state = json.loads(self.backend.decoder.__getstate__()) if self.backend.decoder is not None else {}
            kinds = self._decoder_types = frozenset(s.get("type") for s in [state, *(state.get("decoders") or [])])
        return kinds

    # -- chat -----------------------------------------------------------------------------------------------

    def chat_template_source(self, tools: bool = False, override: str | None = None) -> str:
        """`override` (--chat-template) if given, else the model's template ("tool_use" if tools and it has one)."""
        if override:
            return override
        if not self._templates:
            raise ValueError("this model has no chat template; send a plain prompt (completions) instead "
                             "of chat messages, or start the server with --chat-template FILE")
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        return self._templates.get(name) or self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            **kwargs) -> str:
        """Render messages to a prompt string (`chat_template.render_messages`); extra kwargs
        (chat_template_kwargs) reach the template."""
        return render_messages(self.chat_template_source(bool(tools), chat_template), messages,
                               special_tokens=self.special_tokens, add_generation_prompt=add_generation_prompt,
                               tools=tools, documents=documents, continue_final_message=continue_final_message,
                               **kwargs)


def _hf_template(path: str, cfg: dict) -> str | dict[str, str] | None:
    # Newer transformers save the template next to the config, older ones inside it.
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = (cfg.get("chat_template")
                or _read_json(os.path.join(path, "chat_template.json")).get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        return {t["name"]: t["template"] for t in template}
    return template


# -- streaming -------------------------------------------------------------------------------------------

# Decoding starts a few prompt tokens back so that context-dependent decoders (sentencepiece's leading
# space strip) see the same left context as a full decode would.
_INITIAL_OFFSET = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, O(new tokens) per step.

    Keeps two offsets into the ids (vLLM's technique): text is decoded over [prefix, end) and compared to
    the already-emitted [prefix, read); only the difference is new. A delta ending in U+FFFD is an
    incomplete UTF-8 character split across tokens, so it is held back until the next token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids[-_INITIAL_OFFSET:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, new_ids: list[int]) -> str:
        """Append generated ids; return the newly finalized text (possibly "")."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        # The old read offset becomes the new prefix; ids before it are never decoded again, so drop them.
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        self.text += delta
        return delta
