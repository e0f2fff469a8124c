"""Structured output in the engine (offline LLM API): every finished output matches its grammar.

A tiny random Llama with SmolLM2's tokenizer: its text is random, so the grammar alone makes it valid.
"""

import gc
import json
import re
import time
import weakref

import pytest
import torch
from structured_schemas import SCHEMAS, validate

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams as Spec

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_path(tiny_hf_model):
    return tiny_hf_model("llama", vocab_size=49152, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def llm(tiny_path, smollm_gguf_path):
    return LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB")


def _gen(llm, spec, n=1, temperature=1.0, max_tokens=80, prompts=("Hello", "JSON please"), **kw):
    params = [SamplingParams(n=n, temperature=temperature, seed=i, max_tokens=max_tokens, structured_outputs=spec,
                             **kw) for i in range(len(prompts))]
    return [c for o in llm.generate(list(prompts), params, use_tqdm=False) for c in o.outputs]


def test_engine_without_structured_requests_never_loads_xgrammar(tiny_path, smollm_gguf_path):
    llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="4MiB")
    llm.generate("Hi", SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.engine.structured_output.loaded


@pytest.mark.parametrize("spec, check", [
    (Spec(regex=r"[a-z]{3}-\d{2}"), lambda t: re.fullmatch(r"[a-z]{3}-\d{2}", t)),
    (Spec(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
    (Spec(grammar='root ::= "(" [0-9]+ ")"'), lambda t: re.fullmatch(r"\(\d+\)", t)),
    (Spec(grammar='start: "<" WORD ">"\nWORD: /[a-c]{1,4}/'), lambda t: re.fullmatch(r"<[a-c]{1,4}>", t)),  # Lark
    (Spec(json={"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}),
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_each_kind_greedy_and_sampled_with_n(llm, spec, check):
    outs = _gen(llm, spec, temperature=0.0) + _gen(llm, spec, n=3)
    assert len(outs) == 8
    for c in outs:
        assert c.finish_reason == "stop", c
        assert check(c.text), c.text


def test_json_object_is_an_object_or_cut_by_length(llm):
    outs = _gen(llm, Spec(json_object=True), n=4, max_tokens=40)
    for c in outs:
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40


def test_schemas_are_valid_by_construction(llm):
    """Every schema of the shared set, two samples each: each "stop" output parses and validates."""
    params = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=120, structured_outputs=Spec(json=s))
              for i, s in enumerate(SCHEMAS)]
    outs = llm.generate(["Reply in JSON."] * len(SCHEMAS), params, use_tqdm=False)
    stops = 0
    for schema, out in zip(SCHEMAS, outs, strict=True):
        for c in out.outputs:
            if c.finish_reason == "stop":
                validate(json.loads(c.text), schema)
                stops += 1
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 120
    assert stops >= 0.9 * 2 * len(SCHEMAS)


def test_max_tokens_cut_says_length(llm):
    (c,) = _gen(llm, Spec(regex=r"a{20}"), max_tokens=5, prompts=("x",))
    assert c.finish_reason == "length" and c.text == "a" * len(c.text) and len(c.token_ids) == 5


def test_beam_search_keeps_every_beam_in_the_grammar(llm):
    choices = ["alpha", "beta", "gamma delta", "epsilon"]
    out = llm.generate("Pick one:", SamplingParams(use_beam_search=True, beam_width=4, n=3, temperature=0.0,
                                                   max_tokens=20, structured_outputs=Spec(choice=choices)),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)
    assert len({c.text for c in out.outputs}) == 3


@pytest.mark.parametrize("spec, params, message", [
    (Spec(regex="[a-"), {}, r"structured_outputs\.regex: invalid regex"),
    (Spec(grammar="root ::= foo"), {}, r"structured_outputs\.grammar: .*foo"),
    (Spec(grammar="start: foo"), {}, r"structured_outputs\.grammar: not a valid EBNF .* or Lark"),
    (Spec(json='{"type": '), {}, r"structured_outputs\.json: the schema is not valid JSON"),
    (Spec(json={"type": "strin"}), {}, r"structured_outputs\.json: invalid JSON schema: .*strin"),
    (Spec(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), {},
     r"structured_outputs\.json: the JSON-schema keyword 'not' at /properties/a is not supported"),
    (Spec(json={"type": "string", "format": "idn-email"}), {}, r"string format 'idn-email' .* not supported"),
    (Spec(json={"type": "number", "multipleOf": 0.5}), {}, r"'multipleOf' at / is supported only for"),
    (Spec(json={"type": "array", "uniqueItems": True}), {}, r"'uniqueItems': true at / is not supported"),
    (Spec(json={"type": "object"}, whitespace_pattern="[ ]+"), {}, r"whitespace_pattern .* must accept the empty"),
    (Spec(regex="a", whitespace_pattern=" *"), {}, r"whitespace_pattern applies only to JSON"),
    (Spec(grammar="root ::= root"), {}, r"structured_outputs\.grammar: it matches no text"),  # was a 500 at sampling
    (Spec(regex="[^\\x00-\\U0010FFFF]"), {}, r"structured_outputs\.regex: it matches no text"),
    (Spec(regex="a+"), {"ignore_eos": True}, r"^ignore_eos must be false with structured outputs"),
    (Spec(regex="a+"), {"min_tokens": 2, "max_tokens": 5}, r"^min_tokens must be 0 with structured outputs"),
])
def test_invalid_specs_are_refused_naming_the_field(llm, spec, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(structured_outputs=spec, **params), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_spec_sets_exactly_one_kind_and_an_empty_schema_is_one():
    """json={} is a schema (any JSON value), not "unset": beside a regex it was silently dropped, alone it was
    refused as "got none"; an empty regex or grammar is refused by name."""
    assert Spec(json={}).kind == "json"
    with pytest.raises(ValueError, match=r"exactly one of .* got \['json', 'regex'\]"):
        Spec(json={}, regex="a")
    for kind in ("regex", "grammar"):
        with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind} must be a non-empty string"):
            Spec(**{kind: ""})
    assert Spec(json_object=False, regex="a").kind == "regex"


def test_compiles_once_per_schema_whatever_its_spelling(llm):
    manager = llm.engine.structured_output
    schema = {"type": "object", "properties": {"zz": {"type": "integer", "minimum": 1, "maximum": 3}}}
    before = manager.num_compiled
    manager.compile(Spec(json=schema))
    manager.compile(Spec(json=json.dumps(schema, indent=2)))
    _gen(llm, Spec(json=schema), n=2)
    assert manager.num_compiled == before + 1


def test_the_cache_is_bounded_by_bytes_and_xgrammar_keeps_none(llm, monkeypatch):
    """Our LRU is the one cache (xgrammar's own kept every grammar ever compiled), bounded by entries and by
    xgrammar's count of a grammar's bytes; a spec past MAX_SPEC_CHARS is refused before compiling."""
    import pagellm.structured_output.manager as manager_module

    manager = llm.engine.structured_output
    specs = [Spec(choice=[f"c{k}-{i}" for i in range(50)]) for k in range(6)]
    one = manager.compile(specs[0]).memory_size_bytes
    monkeypatch.setattr(manager_module, "_CACHE_BYTES", 3 * one + one // 2)
    for spec in specs:
        manager.compile(spec)
    assert manager._compiler.get_cache_size_bytes() == 0
    assert 1 <= sum(manager_module._cache_key(s) in manager._cache for s in specs) <= 3
    assert manager._cache_bytes == sum(c.memory_size_bytes for c in manager._cache.values())
    before = manager.num_compiled
    manager.compile(specs[-1])  # the newest is kept
    assert manager.num_compiled == before
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex: the spec is 131073 characters long"):
        manager.compile(Spec(regex="a" * (manager_module.MAX_SPEC_CHARS + 1)))
    assert manager.num_compiled == before


def test_one_compile_per_spec_when_threads_ask_at_once(llm, monkeypatch):
    """The server's compile pool and the engine may ask for the same new spec at once: one compiles, the others
    wait for its grammar (each compile had added its bytes to the LRU's count, which then only grew, until the
    cache held one entry); a failure reaches every waiter."""
    import threading

    manager = llm.engine.structured_output
    real = manager._compile

    def slow(spec, key):
        time.sleep(0.3)  # long enough for every thread to arrive while it runs
        return real(spec, key)

    monkeypatch.setattr(manager, "_compile", slow)
    for spec, fails in ((Spec(choice=["same", "spec", "at once"]), False), (Spec(regex="[a-"), True)):
        before, results = manager.num_compiled, []
        gate = threading.Barrier(3)

        def ask(spec=spec, gate=gate, results=results):
            gate.wait()
            try:
                results.append(manager.compile(spec))
            except ValueError as e:
                results.append(e)

        threads = [threading.Thread(target=ask) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(results) == 3
        if fails:
            assert all(isinstance(r, ValueError) and "invalid regex" in str(r) for r in results)
            assert manager.num_compiled == before
        else:
            assert results[0] is results[1] is results[2] and manager.num_compiled == before + 1
        assert manager._cache_bytes == sum(c.memory_size_bytes for c in manager._cache.values())
        assert not manager._compiling


def test_whitespace_patterns_pick_a_layout_the_pattern_accepts(llm):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "boolean"}}, "required": ["a", "b"]}
    for pattern, allowed in (("", r"[^ \n\t]*"), (r"[ ]?", r"[^\n\t]*"), (None, r"[^\n\t]*")):
        for c in _gen(llm, Spec(json=schema, whitespace_pattern=pattern), n=2):
            outside_strings = re.sub(r'"[^"]*"', "", c.text)
            assert re.fullmatch(allowed, outside_strings), (pattern, c.text)
            validate(json.loads(c.text), schema)


def test_greedy_structured_output_is_identical_with_ngram_speculation(tiny_path, smollm_gguf_path, llm):
    """Drafts are checked against the grammar: speculation may not change a greedy structured output."""
    spec_llm = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="16MiB", speculative_method="ngram",
                   num_speculative_tokens=4, speculative_adaptive=False)
    # Repeated text gives the n-gram proposer drafts, many of which the grammar rejects.
    prompts = ['{"a": 1, "b": [1, 2, 3]} {"a": 1, "b": [1, 2, 3]} {"a": 1, "b": [1, 2',
               "abab abab abab abab ab", "(1234)(1234)(1234)(12"]
    specs = [Spec(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {
                 "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 6}},
                 "required": ["a", "b"]}),
             Spec(regex=r"(ab ?){1,12}"), Spec(grammar='root ::= ("(" [0-9]+ ")")+')]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=s) for s in specs]
    plain = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    drafted = [o.outputs[0] for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    assert spec_llm.engine.scheduler.stats.num_draft_tokens > 0
    assert [c.token_ids for c in drafted] == [c.token_ids for c in plain]


def test_recompute_preemption_keeps_outputs_valid_and_equal(tiny_path, smollm_gguf_path, llm):
    """A cache too small for the batch preempts by recompute: the grammar state follows the kept output."""
    small = LLM(tiny_path, tokenizer=smollm_gguf_path, kv_cache_memory="160KiB", block_size=16, max_num_seqs=16)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 15,
              "maxItems": 30}
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=Spec(json=schema))
    prompts = [f"numbers {i}:" for i in range(12)]
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.scheduler.stats.num_preemptions > 0
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for o in got:
        if o.outputs[0].finish_reason == "stop":
            validate(json.loads(o.outputs[0].text), schema)


def test_finished_and_aborted_requests_free_their_matchers(llm):
    engine = llm.engine
    states = []
    new_state = engine.structured_output.new_state

    def tracked(spec):
        state = new_state(spec)
        states.append(weakref.ref(state))
        return state

    engine.structured_output.new_state = tracked
    try:
        _gen(llm, Spec(regex="[0-9]{1,3}"), n=2)
        engine.add_request("to-abort", "x", SamplingParams(max_tokens=50, structured_outputs=Spec(regex="[a-z]+")))
        for _ in range(3):
            engine.step()
        engine.abort_request("to-abort")
    finally:
        engine.structured_output.new_state = new_state
    assert not engine.has_unfinished_requests()
    gc.collect()
    assert len(states) == 5 and all(ref() is None for ref in states)


def test_bitmask_cost_for_16_structured_rows(llm):
    """The grammar work of a decode step with 16 structured rows stays small (measured, not modelled)."""
    from pagellm.structured_output import apply_grammar_masks

    engine = llm.engine
    schema = SCHEMAS[1]
    for i in range(16):
        engine.add_request(f"cost-{i}", "Hi", SamplingParams(seed=i, max_tokens=30,
                                                             structured_outputs=Spec(json=schema)))
    timings = []
    real = apply_grammar_masks

    def timed(scheduled, logits, new_state):
        t0 = time.perf_counter()
        real(scheduled, logits, new_state)
        if sum(s.request.params.structured_outputs is not None for s in scheduled) == 16:
            timings.append(time.perf_counter() - t0)

    import pagellm.sample.step as step_module
    step_module.apply_grammar_masks = timed
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        step_module.apply_grammar_masks = real
    assert len(timings) >= 5
    median = sorted(timings)[len(timings) // 2]
    print(f"grammar masks for 16 rows: median {median * 1e3:.2f} ms per step over {len(timings)} steps")
    assert median < 0.05  # generous: a shared 2-core CI machine; measured ~1 ms


def test_grammar_state_drafts_stop_at_the_first_rejected_token(llm):
    """Unit check of the speculative path: row j's mask is the state after drafts[:j]; rollback after."""
    import xgrammar as xgr

    tok = llm.get_tokenizer()
    state = llm.engine.structured_output.new_state(Spec(regex="ab+c"))
    a, b, c = (tok.encode(x, add_special_tokens=False)[0] for x in "abc")
    bitmask = xgr.allocate_token_bitmask(4, 49152)
    assert state.fill_drafts([a, b, a], bitmask, 0, "r") == 2  # the second "a" breaks the grammar

    def allowed(row, token):
        return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)

    assert allowed(0, a) and not allowed(0, b)
    assert allowed(1, b) and not allowed(1, c) and not allowed(1, a)
    assert allowed(2, b) and allowed(2, c) and not allowed(2, a)
    assert torch.all(bitmask[3] == -1)  # after the rejected draft: never read, left unmasked
    assert state.valid_prefix([a, b, b, a, c]) == (3, True)  # what trim_drafts keeps before scheduling
    assert state.valid_prefix([a, b]) == (2, False)
    assert state.num_accepted == 0 and state.matcher.accept_token(a)  # rolled back to the start


def test_draft_model_drafts_keep_the_first_rejected_one(llm):
    """trim_drafts cuts point-mass drafts (n-gram) before the first token the grammar rejects, but keeps that
    token for drafts drawn from a draft model's q: verification then rejects it and draws from the residual
    (p - q)+, as rejection sampling must (drawing from p there biased sampled output: a probe's 600 seeds at
    temperature 1 gave P(" is yes") 0.277 against plain decoding's 0.373)."""
    from types import SimpleNamespace

    from pagellm.structured_output.request_state import trim_drafts

    tok = llm.get_tokenizer()
    a, b, c = (tok.encode(x, add_special_tokens=False)[0] for x in "abc")
    new_state = llm.engine.structured_output.new_state

    def request(probs):
        return SimpleNamespace(spec_token_ids=[a, b, a, c], spec_draft_probs=probs, request_id="r",
                               params=SimpleNamespace(structured_outputs=Spec(regex="ab+c")), grammar=None,
                               output_token_ids=[])

    ngram, drafted = request(None), request(torch.rand(4, 8))
    trim_drafts([ngram, drafted], new_state)
    assert ngram.spec_token_ids == [a, b] and ngram.spec_draft_probs is None
    assert drafted.spec_token_ids == [a, b, a] and drafted.spec_draft_probs.shape[0] == 3
