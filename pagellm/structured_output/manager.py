"""StructuredOutputManager: pagellm's tokenizer as xgrammar sees it, and a cache of compiled grammars."""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.structured_output.request_state import GrammarState, trim_drafts
from pagellm.structured_output.schema_check import unsupported_schema_feature

_CACHE_ENTRIES = 512  # compiled grammars kept (LRU); each holds its token-mask cache
_CACHE_BYTES = 256 << 20  # and at most this much of them (xgrammar's own count, memory_size_bytes)
# The longest spec compiled (a schema's JSON text, a regex, a grammar, the choices' total length): xgrammar's
# compile time grows faster than the spec, and a compile cannot be stopped once started. Choice lists on
# SmolLM2's vocabulary (benchmarks/microbench_grammar_compile.py; NOTES, thirty-second session): 41 KB 0.03 s,
# 65-125 KB 0.06-2.4 s, 150 KB 0.5-3.6 s, 310 KB 10-16 s.
MAX_SPEC_CHARS = 131_072
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: ": noise to a client.
_XGR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
# Whitespace runs xgrammar's any_whitespace mode may produce between JSON tokens (it allows [ \n\t]*).
_ANY_WHITESPACE_SAMPLES = ("", " ", "\n", "\t", "  ", " \n\t \n  \t")


class StructuredOutputManager:
    """Compiles StructuredOutputsParams into xgrammar grammars, thread-safely and once per spec.

    Constructing it costs nothing: xgrammar is imported and the tokenizer's vocabulary converted on the
    first compile, so an engine that never sees a structured request never pays for either."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width, which may exceed the tokenizer's vocab
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self._lock = threading.Lock()
        self._compiler = None
        self._info = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cache_bytes = 0
        # specs being compiled: one compile per spec at a time (xgrammar's own cache, off, had merged them)
        self._compiling: dict[tuple, Future] = {}
        self._json_masks: dict[bool, Any] = {}
        self.num_compiled = 0  # compilations actually run (cache misses): tests and metrics read it

    @property
    def loaded(self) -> bool:
        """Whether xgrammar has been loaded (only a structured request loads it)."""
        return self._compiler is not None

    # ---- requests -------------------------------------------------------------------------------
    def validate(self, params: SamplingParams) -> None:
        """Refuse what cannot work with a grammar, and compile it (a cache hit if the server did)."""
        spec = params.structured_outputs
        if spec is None:
            return
        if params.ignore_eos:
            raise ValueError("ignore_eos must be false with structured outputs: the output ends where the "
                             "grammar is complete (the grammar then allows only the end-of-sequence token)")
        if params.min_tokens:
            raise ValueError("min_tokens must be 0 with structured outputs: the grammar decides where the "
                             "output may end, and banning the end-of-sequence token could leave no token")
        compiled = self.compile(spec)
        if params.allowed_token_ids is not None:
            first = self._first_tokens(compiled).tolist()  # one copy: the list may hold the whole vocabulary
            if not any(0 <= t < self.vocab_size and (first[t // 32] >> (t % 32)) & 1
                       for t in params.allowed_token_ids):
                raise ValueError("allowed_token_ids must hold a token that can start the structured output "
                                 "(none of them can)")

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        import xgrammar as xgr

        compiled = self.compile(spec)
        extra = None
        if spec.kind in ("json", "json_object"):
            extra = self.json_token_mask(_json_layout(spec.whitespace_pattern)["any_whitespace"])
        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids),
                            frozenset(self.stop_token_ids), extra)

    def trim_drafts(self, requests) -> None:
        """Cut speculative drafts at the first token each sequence's grammar rejects."""
        trim_drafts(requests, self.new_state)

    def json_token_mask(self, any_whitespace: bool):
        """Tokens JSON output may use at all: none with a raw control character (JSON escapes them in
        strings), except newline and carriage return between tokens with any whitespace. xgrammar 0.2.9
        lets a string with minLength/maxLength contain raw control characters (tab, \\x07, ...), which
        json.loads refuses; this mask closes that hole. Tab is left out even between tokens, as it cannot
        be told apart from a tab inside such a string: the output's whitespace is then a subset of any."""
        with self._lock:
            mask = self._json_masks.get(any_whitespace)
            if mask is None:
                mask = self._json_masks[any_whitespace] = _byte_mask(
                    self._info.decoded_vocab, self.vocab_size,
                    {0x0A, 0x0D} if any_whitespace else set())
            return mask

    # ---- compiling --------------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputsParams):
        """The xgrammar CompiledGrammar for `spec`; ValueError("structured_outputs.<kind>: ...") if it is
        invalid or uses what xgrammar cannot enforce. Safe to call from several threads."""
        key = _cache_key(spec)
        size = _spec_chars(key)
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{spec.kind}: the spec is {size} characters long, more than the "
                             f"{MAX_SPEC_CHARS} pagellm compiles")
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            running = self._compiling.get(key)
            if running is None:  # this thread compiles it; others asking meanwhile wait for its result
                running = self._compiling[key] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            return running.result()  # the compile's ValueError too
        try:
            compiled = self._compile(spec, key)  # outside the lock: compiling a big schema takes a while
        except BaseException as e:
            with self._lock:
                del self._compiling[key]
            running.set_exception(e)
            raise
        with self._lock:
            del self._compiling[key]
            self.num_compiled += 1
            self._cache[key] = compiled
            self._cache_bytes += compiled.memory_size_bytes
            while len(self._cache) > 1 and (len(self._cache) > _CACHE_ENTRIES or self._cache_bytes > _CACHE_BYTES):
                self._cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        running.set_result(compiled)
        return compiled

    def _compile(self, spec: StructuredOutputsParams, key: tuple):
        compiled = self._compile_spec(spec, key)
        if not self._can_start(compiled):  # e.g. "root ::= root": its first sample would fail in the engine
            raise ValueError(f"structured_outputs.{spec.kind}: it matches no text (no token can start the output)")
        return compiled

    def _can_start(self, compiled) -> bool:
        """Whether the grammar allows some first token (one step's mask, once per compiled spec)."""
        return bool(self._first_tokens(compiled).any())

    def _first_tokens(self, compiled):
        """The grammar's first-step mask: int32 words, bit t % 32 of word t // 32 set where token t may start."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids)
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        return mask[0]

    def _compile_spec(self, spec: StructuredOutputsParams, key: tuple):
        kind = spec.kind
        compiler = self._get_compiler()
        try:
            if kind == "json":
                schema = json.loads(key[1])
                problem = unsupported_schema_feature(schema)
                if problem:
                    raise ValueError(problem)
                return compiler.compile_json_schema(key[1], **_json_layout(spec.whitespace_pattern))
            if kind == "json_object":
                # Any object: strict mode would forbid every property an object schema does not name.
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                    **_json_layout(spec.whitespace_pattern))
            if spec.whitespace_pattern is not None:
                raise ValueError("whitespace_pattern applies only to JSON (json or json_object)")
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return _compile_grammar(compiler, spec.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind}: {_describe(kind, e)}") from None

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
                # xgrammar's own cache off: it keeps every grammar ever compiled (no limit by default); the
                # LRU above is the one cache
                self._compiler = xgr.GrammarCompiler(self._info, max_threads=min(8, os.cpu_count() or 1),
                                                     cache_enabled=False)
            return self._compiler


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of a pagellm Tokenizer: each id's token as stored, and how to read it as bytes."""
    import xgrammar as xgr

    backend = tokenizer.backend
    encoded = [""] * vocab_size  # ids past the tokenizer (padded logits) stay empty: never allowed
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size:
            encoded[i] = token
    kinds = tokenizer.decoder_kinds()
    if "ByteLevel" in kinds:  # GPT-2's printable spelling of bytes (SmolLM2, Llama 3, Qwen2)
        vocab_type, prefix_space = xgr.VocabType.BYTE_LEVEL, False
    elif "ByteFallback" in kinds:  # sentencepiece: "▁" for a space, <0xNN> for raw bytes
        vocab_type = xgr.VocabType.BYTE_FALLBACK
        ids = tokenizer.encode("a", add_special_tokens=False)
        prefix_space = bool(ids) and backend.id_to_token(ids[0]).startswith("▁")
    else:
        vocab_type, prefix_space = xgr.VocabType.RAW, False
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                             add_prefix_space=prefix_space)


def _byte_mask(decoded_vocab: list[bytes], vocab_size: int, allowed_controls: set[int]):
    """A bitmask row allowing every token without a control byte other than `allowed_controls`."""
    import torch
    import xgrammar as xgr

    banned = [i for i, b in enumerate(decoded_vocab[:vocab_size])
              if any(c < 0x20 and c not in allowed_controls for c in b)]
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[banned] = False
    row = xgr.allocate_token_bitmask(1, vocab_size)[0]
    bits = torch.zeros(row.numel() * 32, dtype=torch.int64)
    bits[:vocab_size] = allowed.to(torch.int64)
    words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)  # < 2**32: fits int64, wraps into int32
    row.copy_(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
    return row


def _cache_key(spec: StructuredOutputsParams) -> tuple:
    """A spec's identity: the same schema as a dict or as JSON text is one entry. Key order is kept:
    it is the order the output's properties are generated in."""
    kind = spec.kind
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json: the schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json: the schema must be a JSON object, got "
                             f"{type(schema).__name__}")
        try:
            value = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json: the schema is not JSON-serializable: {e}") from None
    elif kind == "json_object":
        value = True
    else:
        value = getattr(spec, kind)
    return kind, value, spec.whitespace_pattern


def _spec_chars(key: tuple) -> int:
    value = key[1]
    if isinstance(value, str):
        return len(value)
    if isinstance(value, tuple):  # choice: the alternatives and a separator each
        return sum(len(c) + 1 for c in value)
    return 0


def _json_layout(whitespace_pattern: str | None) -> dict:
    """xgrammar's JSON layout for a whitespace pattern. xgrammar takes no pattern, so pick the layout
    whose whitespace the pattern accepts everywhere: any whitespace, one space after , and :, or none.
    Without a pattern: one space after , and : (any_whitespace lets small models emit whitespace forever)."""
    if whitespace_pattern is None:
        return {"any_whitespace": False}
    try:
        ws = re.compile(whitespace_pattern)
    except re.error as e:
        raise ValueError(f"whitespace_pattern is not a valid regex: {e}") from None
    if all(ws.fullmatch(s) for s in _ANY_WHITESPACE_SAMPLES):
        return {"any_whitespace": True}
    if ws.fullmatch("") and ws.fullmatch(" "):
        return {"any_whitespace": False, "separators": (", ", ": ")}
    if ws.fullmatch(""):
        return {"any_whitespace": False, "separators": (",", ":")}
    raise ValueError(f"whitespace_pattern {whitespace_pattern!r} is not supported: it must accept the empty "
                     "string (xgrammar writes JSON with no whitespace, one space after , and :, or any)")


def _compile_grammar(compiler, grammar: str):
    """EBNF (GBNF, rules written `name ::= ...`, root rule `root`) or else Lark (`start: ...`)."""
    if "::=" in grammar:
        return compiler.compile_grammar(grammar)
    try:
        return compiler.compile_lark(grammar)
    except RuntimeError as e:
        raise ValueError(f"not a valid EBNF (GBNF, `root ::= ...`) or Lark (`start: ...`) grammar: "
                         f"{_clean(e)}") from None


def _describe(kind: str, e: Exception) -> str:
    what = {"json": "invalid JSON schema", "json_object": "invalid JSON layout", "regex": "invalid regex",
            "choice": "invalid choice", "grammar": "invalid grammar"}[kind]
    msg = _clean(e)
    return msg if isinstance(e, ValueError) else f"{what}: {msg}"


def _clean(e: Exception) -> str:
    return _XGR_PREFIX.sub("", str(e)).strip().splitlines()[0] if str(e).strip() else type(e).__name__
