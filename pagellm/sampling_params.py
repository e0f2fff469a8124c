"""SamplingParams with vLLM's field names, validated with errors that name the field and its range."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# vLLM takes any repetition penalty > 0; the sampler divides and multiplies float32 logits by it, where past
# these bounds it turns into 0 or inf (and logits into inf or NaN): far beyond any useful penalty (HF: ~1.2).
REPETITION_PENALTY_MIN = 1e-6
LENGTH_PENALTY_MAX = 10.0  # (2**20 tokens) ** 10 is 2**200: far from float overflow
_SEED_MIN, _SEED_MAX = -2**63, 2**64 - 1  # what torch.Generator.manual_seed accepts


_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _is_set(kind: str, value) -> bool:
    return bool(value) if kind == "json_object" else value is not None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's `structured_outputs`): exactly one of json (a JSON schema, as a
    dict or its JSON text), json_object (any JSON object), regex, choice (one of these strings) or grammar
    (EBNF/GBNF or Lark). Compiled by pagellm/structured_output; plain data here."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None  # JSON only: the regex whitespace between tokens must match

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        # set = not None (json_object: true); json={} is a schema (any JSON value), not "unset"
        given = [k for k in _KINDS if _is_set(k, getattr(self, k))]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, regex, choice or "
                             f"grammar, got {given or 'none'}")
        if getattr(self, given[0]) == "":  # a regex or a grammar
            raise ValueError(f"structured_outputs.{given[0]} must be a non-empty string")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if _is_set(k, getattr(self, k)))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    beam_width: int | None = None  # beams kept per step; None -> n
    length_penalty: float = 1.0  # final score = sum logprob / generated_len ** length_penalty
    # The output must match this schema/regex/choice/grammar (pagellm/structured_output).
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled
    bad_words: list[str] | None = None  # never generate these words (each as its token sequence)
    prompt_logprobs: int | None = None  # logprob of every prompt token plus its top-N
    truncate_prompt_tokens: int | None = None  # keep only the last N prompt tokens
    # bad_words as token sequences, filled by the engine's tokenizer at admission (vLLM's
    # update_from_tokenizer); the sampler reads these, not the words.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.verify()

    def verify(self) -> None:
        """Normalize and check every field (ValueError naming it). Run at construction, and again by the engine
        when a request is admitted: a caller may change a field afterwards (p.n = 0 failed deep in a step)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):  # one word, as stop takes one string
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):  # the dataclass's fields as a dict (a JSON body's shape)
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict of its fields, got "
                             f"{type(self.structured_outputs).__name__}")
        for name in ("stop", "stop_token_ids", "allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):  # a stop string is a list by now
                raise ValueError(f"{name} must be a list, got {value!r}")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self):
        def bad(name, rule, value):
            raise ValueError(f"{name} must be {rule}, got {value!r}")

        # Python callers can pass anything; a None or a string must fail naming its field, not in a compare.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                bad(name, "a number", value)
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "beam_width", "prompt_logprobs",
                     "truncate_prompt_tokens"):
            if isinstance(getattr(self, name), bool):  # an int to isinstance: True would be 1
                bad(name, "an integer, not a boolean", getattr(self, name))
        for name in ("stop_token_ids", "allowed_token_ids"):
            if any(isinstance(t, bool) for t in getattr(self, name) or ()):
                bad(name, "a list of token ids (integers, not booleans)", getattr(self, name))
        if any(isinstance(t, bool) or not isinstance(t, int) for t in self.logit_bias or {}):
            bad("logit_bias", "keyed by token ids (integers)", self.logit_bias)
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "an integer >= 1", self.n)
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "in [0, 100]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            bad("top_k", "-1 (disabled) or an integer >= 1", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]", self.min_p)
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not REPETITION_PENALTY_MIN <= self.repetition_penalty <= 1 / REPETITION_PENALTY_MIN:
            bad("repetition_penalty", f"in [{REPETITION_PENALTY_MIN:g}, {1 / REPETITION_PENALTY_MIN:g}]",
                self.repetition_penalty)
        if not -LENGTH_PENALTY_MAX <= self.length_penalty <= LENGTH_PENALTY_MAX:  # NaN fails too
            # a beam's score divides by length ** length_penalty: past this, float overflow or division by zero
            # in the engine's step (HF and vLLM users pass 0-2)
            bad("length_penalty", f"in [-{LENGTH_PENALTY_MAX:g}, {LENGTH_PENALTY_MAX:g}]", self.length_penalty)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "an integer in [0, 20]", self.logprobs)
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not _SEED_MIN <= self.seed <= _SEED_MAX - (self.n - 1)):
            # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; sample i of n is seeded seed + i.
            bad("seed", f"an integer in [{_SEED_MIN}, {_SEED_MAX - (self.n - 1)}]", self.seed)
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "a list of non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative token ids", self.stop_token_ids)
        if self.use_beam_search:
            if self.beam_width is None:
                self.beam_width = max(self.n, 2)
            if not isinstance(self.beam_width, int) or self.beam_width < 1:
                bad("beam_width", "an integer >= 1", self.beam_width)
            if self.n > self.beam_width:
                bad("n", f"<= beam_width ({self.beam_width}) with beam search", self.n)
            if self.max_tokens is None:
                bad("max_tokens", "set (an integer >= 1) with beam search", self.max_tokens)
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", "an integer in [0, 20]", self.prompt_logprobs)
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "a non-empty list of non-negative token ids", self.allowed_token_ids)
        if self.bad_words is not None and any(not isinstance(w, str) or not w for w in self.bad_words):
            bad("bad_words", "a list of non-empty strings", self.bad_words)
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens < -1
                                                        or self.truncate_prompt_tokens == 0):
            # -1 (vLLM): keep as many of the last prompt tokens as the context leaves room for.
            bad("truncate_prompt_tokens", "-1 or an integer >= 1", self.truncate_prompt_tokens)
        if self.use_beam_search:
            # beam_candidates ranks the raw logprobs and ends a beam at the end-of-sequence token only: what it
            # would silently not apply is refused, as the server refuses it (temperature, top_p, top_k and
            # min_p change no ranking; their defaults are sampling's, so they are not checked here)
            ignored = {"allowed_token_ids": self.allowed_token_ids is not None, "bad_words": bool(self.bad_words),
                       "logit_bias": bool(self.logit_bias), "presence_penalty": self.presence_penalty != 0.0,
                       "frequency_penalty": self.frequency_penalty != 0.0,
                       "repetition_penalty": self.repetition_penalty != 1.0, "stop": bool(self.stop),
                       "stop_token_ids": bool(self.stop_token_ids), "min_tokens": self.min_tokens != 0,
                       "logprobs": self.logprobs is not None}
            name = next((k for k, v in ignored.items() if v), None)
            if name is not None:
                bad(name, "unset with use_beam_search (beam search does not apply it)", getattr(self, name))
        for tok, bias in (self.logit_bias or {}).items():
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                bad(f"logit_bias[{tok}]", "in [-100, 100]", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def child(self, index: int) -> SamplingParams:
        """Params for the index-th of n parallel samples: one sequence each, distinct seeds."""
        import dataclasses

        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, for LLM.beam_search: the beam_width best sequences of at most max_tokens new
    tokens, ranked by their summed logprob / generated length ** length_penalty."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def to_sampling_params(self) -> SamplingParams:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or self.temperature != 0.0:
            # The beams rank the model's own logprobs (transformers' num_beams, vLLM's raw logprobs): a
            # temperature would change nothing, so one that is set is refused rather than ignored.
            raise ValueError(f"temperature must be 0 with beam search (beams rank the model's logprobs), "
                             f"got {self.temperature!r}")
        return SamplingParams(n=self.beam_width, use_beam_search=True, beam_width=self.beam_width,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, temperature=0.0,
                              length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output)
