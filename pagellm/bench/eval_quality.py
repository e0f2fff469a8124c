"""`pagellm eval`: how far a configuration (weight format, dtype, KV cache dtype, int8 activations) moves the
model's outputs away from a float32 baseline, and what it buys (bytes, tokens of KV, speed).

Both engines run in this process, one after the other: the baseline first (its greedy outputs and its
full-vocabulary distributions at those outputs' positions are kept), then it is freed and the candidate
loads. Everything is greedy (temperature 0), so a run is deterministic. The figures:

- perplexity / baseline_perplexity: exp(-mean log p(token_j | tokens_<j)) over the text's tokens j >= 1,
  from the engine's own prompt logprobs (`SamplingParams(prompt_logprobs=0)`; prefill in steps of the
  engine's token budget).
- greedy_agreement: free-running. Each engine generates its own greedy continuation of every prompt (up to
  --max-tokens, stopping at EOS); per prompt, the number of leading tokens the candidate's output shares
  with the baseline's, divided by the baseline's length; the mean over prompts. greedy_agreement_worst is
  the lowest prompt. One near-tie flipped early ends the match, so this is the strict, user-visible figure.
- teacher-forced figures: the candidate reads the baseline's prompt + output tokens, and at every position
  that predicted a baseline output token both distributions are compared (`LLM.next_token_logprobs`, in
  steps of --score-chunk rows: 16 = the few-row path decoding runs on). kl_mean / kl_p99: KL(baseline ||
  candidate) in nats over all those positions (p99: nearest rank); top1_agreement_wide_margin: the fraction
  of positions whose baseline top-1 beats its top-2 by more than --margin nats where the candidate's top-1
  is the same token (near-ties are excluded: there, either answer is fine).
- weights_bytes (parameters + packed copies), kv_bytes_per_token and kv_tokens (what --kv-cache-memory
  holds), and speed: prefill_tok_s = text tokens / the time of one generate(max_tokens=1) of the text with
  an empty prefix cache (best of 2); decode_tok_s = single-stream output tokens after the first / the time
  of the engine steps that produced them (--decode-tokens, ignore_eos).
"""

from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import dataclass
from importlib import resources

import torch

from pagellm.config import EngineArgs
from pagellm.model.loader import resolve_model_path
from pagellm.sampling_params import SamplingParams

# The figures every result carries (the JSON's contract; tests/test_eval_quality.py checks them).
EVAL_FIELDS = ("perplexity", "baseline_perplexity", "greedy_agreement", "greedy_agreement_worst",
               "top1_agreement_wide_margin", "kl_mean", "kl_p99", "weights_bytes", "kv_bytes_per_token",
               "kv_tokens", "decode_tok_s", "prefill_tok_s")
BASELINE_CONFIG = {"quantization": "none", "dtype": "float32", "kv_cache_dtype": "float32",
                   "int8_activations": False}


@dataclass
class EvalData:
    text: str
    prompts: list[tuple[str, str]]  # (name, prompt)
    text_source: str
    prompts_source: str


@dataclass
class Reference:
    """What the baseline run leaves for the candidates: its token ids, outputs and distributions."""

    config: dict
    perplexity: float
    text_ids: list[int]
    prompt_ids: list[list[int]]
    outputs: list[list[int]]  # greedy tokens per prompt
    rows: list[torch.Tensor]  # [len(output), vocab] log-softmax at the positions that predicted them
    vocab_size: int
    wall_s: float
    phase_s: dict


def load_eval_data(text_path: str | None = None, prompts_path: str | None = None) -> EvalData:
    """The shipped text and prompts (pagellm/bench/eval_data/) unless paths are given; ValueError naming
    the file for anything unreadable or malformed."""
    shipped = resources.files("pagellm.bench") / "eval_data"
    text_src = text_path or str(shipped / "text.txt")
    prompts_src = prompts_path or str(shipped / "prompts.json")
    text = _read(text_src, "text")
    if len(text.strip()) < 2:
        raise ValueError(f"text file {text_src}: is empty")
    try:
        items = json.loads(_read(prompts_src, "prompts"))
    except json.JSONDecodeError as e:
        raise ValueError(f"prompts file {prompts_src}: not JSON ({e})") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"prompts file {prompts_src}: expected a non-empty JSON list of prompts")
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            item = {"name": f"prompt{i}", "prompt": item}
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f"prompts file {prompts_src}: entry {i} must be a string or "
                             f'{{"name": ..., "prompt": "non-empty text"}}')
        prompts.append((str(item.get("name", f"prompt{i}")), item["prompt"]))
    return EvalData(text, prompts, text_src, prompts_src)


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} file {path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None


def kl_divergence(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) per row, in nats, from log-probability rows [R, vocab]: sum_v P(v) (log P(v) - log Q(v)),
    accumulated in float64. Tokens P gives probability 0 contribute 0 (even where Q is -inf too); rounding
    can make a near-zero sum negative, which is clamped to 0 (KL is never negative)."""
    p = p_logprobs.double()
    q = q_logprobs.double()
    terms = torch.where(p > -math.inf, p.exp() * (p - q), torch.zeros_like(p))
    return terms.sum(dim=-1).clamp_min(0.0)


def nearest_rank_percentile(values: list[float], pct: float) -> float:
    """The smallest value with at least pct% of the values at or below it (nearest-rank definition)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(math.ceil(pct / 100 * len(ordered)) - 1, 0)]


def common_prefix_fraction(reference: list[int], candidate: list[int]) -> float:
    """Leading tokens of `candidate` equal to `reference`'s, as a fraction of len(reference)."""
    n = 0
    for a, b in zip(reference, candidate, strict=False):
        if a != b:
            break
        n += 1
    return n / len(reference) if reference else 1.0


def engine_args(model: str | None, tokenizer: str | None, kv_cache_memory: str, num_threads: int | None,
                config: dict) -> EngineArgs:
    """EngineArgs of one configuration (validated now, before any model loads). The strings go to EngineArgs
    as given, so formats added to config.QUANTIZATIONS / KV_CACHE_DTYPES work here unchanged."""
    unknown = set(config) - set(EngineArgs.field_names())
    if unknown:
        raise ValueError(f"unknown engine option(s) in configuration: {', '.join(sorted(unknown))}")
    kw = {"model": model, "tokenizer": tokenizer, "kv_cache_memory": kv_cache_memory, "num_threads": num_threads}
    return EngineArgs(**{**kw, **config})


def check_paths(args: EngineArgs) -> None:
    """A configuration's model and tokenizer paths exist (a matrix row's own "model" too): checked for every
    row that will run before the baseline spends its minutes."""
    for what, path in (("model", args.model), ("tokenizer", args.tokenizer)):
        if path is not None:
            resolve_model_path(path, what)


def _load(args: EngineArgs):
    from pagellm import LLM

    fields = {k: v for k, v in vars(args).items() if k != "model"}
    return LLM(args.model, **fields)


def _release(platform) -> None:
    """Once the caller has dropped its last reference to the engine: collect it and hand the freed memory
    back to the system (malloc_trim), before the next engine loads."""
    gc.collect()
    platform.release_free_memory()


def encode_prompts(llm, prompts: list[tuple[str, str]], chat: bool) -> list[list[int]]:
    tok = llm.get_tokenizer()
    if chat:
        return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                           add_special_tokens=False) for _, p in prompts]
    return [tok.encode(p) for _, p in prompts]


def text_perplexity(llm, text_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of text tokens 1.. from the engine's prompt logprobs."""
    out = llm.generate([text_ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    logprobs = [entry[tok].logprob for tok, entry in zip(text_ids[1:], out.prompt_logprobs[1:], strict=True)]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy_outputs(llm, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def teacher_forced_rows(llm, prompt: list[int], output: list[int], chunk: int) -> torch.Tensor:
    """[len(output), vocab]: the distribution at each position that predicted an output token."""
    return llm.next_token_logprobs(prompt + output[:-1], start=len(prompt) - 1, chunk=chunk)[0]


def measure_speed(llm, text_ids: list[int], prompt: list[int], decode_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, single-stream decode tokens/s), measured with the engine (module docstring)."""
    best = math.inf
    for _ in range(2):  # best of 2: the machine may be shared
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([text_ids], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    llm.reset_prefix_cache()
    engine = llm.engine
    engine.add_request("eval-decode-speed", prompt,
                       SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True))
    first = t_first = None
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced = len(out.outputs[0].token_ids)
        if t_first is None and produced:
            first, t_first = produced, time.perf_counter()
    decode_s = time.perf_counter() - t_first
    return len(text_ids) / best, (produced - first) / decode_s if decode_s > 0 else math.nan


def run_reference(args: EngineArgs, data: EvalData, max_tokens: int, chunk: int, chat: bool) -> Reference:
    clock = _PhaseClock()
    llm = _load(args)
    try:
        clock.lap("load")
        text_ids = llm.get_tokenizer().encode(data.text)
        _check_fits(llm, text_ids, "the text")
        prompt_ids = encode_prompts(llm, data.prompts, chat)
        perplexity = text_perplexity(llm, text_ids)
        clock.lap("perplexity")
        outputs = greedy_outputs(llm, prompt_ids, max_tokens)
        clock.lap("greedy")
        rows = [teacher_forced_rows(llm, p, o, chunk) for p, o in zip(prompt_ids, outputs, strict=True)]
        clock.lap("teacher_forced")
        vocab = llm.engine.model_config.vocab_size
    finally:
        platform = llm.engine.platform
        del llm
        _release(platform)
    return Reference(config_of(args), perplexity, text_ids, prompt_ids, outputs, rows, vocab, clock.total(),
                     clock.phases)


def run_candidate(args: EngineArgs, data: EvalData, ref: Reference, chunk: int, chat: bool, margin: float,
                  decode_tokens: int) -> dict:
    """One configuration against the reference: every EVAL_FIELDS figure, plus counts and wall time."""
    clock = _PhaseClock()
    llm = _load(args)
    engine = llm.engine
    try:
        clock.lap("load")
        text_ids = llm.get_tokenizer().encode(data.text)
        if (text_ids != ref.text_ids or encode_prompts(llm, data.prompts, chat) != ref.prompt_ids
                or engine.model_config.vocab_size != ref.vocab_size):
            raise ValueError("the candidate and the baseline tokenize the text or prompts differently (or have "
                             "different vocabularies): token-level comparison needs one tokenizer")
        perplexity = text_perplexity(llm, text_ids)
        clock.lap("perplexity")
        outputs = greedy_outputs(llm, ref.prompt_ids, len(max(ref.outputs, key=len)))
        clock.lap("greedy")
        kls: list[float] = []
        wide = wide_agree = top1_agree = 0
        for prompt, out, base in zip(ref.prompt_ids, ref.outputs, ref.rows, strict=True):
            cand = teacher_forced_rows(llm, prompt, out, chunk)
            kls.extend(kl_divergence(base, cand).tolist())
            top2 = base.topk(2, dim=-1)
            same = cand.argmax(dim=-1) == top2.indices[:, 0]
            is_wide = (top2.values[:, 0] - top2.values[:, 1]) > margin
            top1_agree += int(same.sum())
            wide += int(is_wide.sum())
            wide_agree += int((same & is_wide).sum())
        clock.lap("teacher_forced")
        prefill_tok_s, decode_tok_s = measure_speed(llm, text_ids, ref.prompt_ids[0], decode_tokens)
        clock.lap("speed")
        agreement = [common_prefix_fraction(b, c) for b, c in zip(ref.outputs, outputs, strict=True)]
        result = {
            "perplexity": perplexity, "baseline_perplexity": ref.perplexity,
            "greedy_agreement": sum(agreement) / len(agreement), "greedy_agreement_worst": min(agreement),
            "top1_agreement_wide_margin": wide_agree / wide if wide else None,  # None: no wide-margin position
            "kl_mean": sum(kls) / len(kls), "kl_p99": nearest_rank_percentile(kls, 99),
            "weights_bytes": engine.weights_bytes,
            "kv_bytes_per_token": engine.bytes_per_block // engine.kv_cache.block_size,
            "kv_tokens": engine.kv_cache.capacity_tokens,
            "decode_tok_s": decode_tok_s, "prefill_tok_s": prefill_tok_s,
            # context for the figures above
            "top1_agreement": top1_agree / len(kls), "kl_max": max(kls), "positions": len(kls),
            "wide_margin_positions": wide, "margin": margin, "text_tokens": len(text_ids),
            "prompts": len(ref.prompt_ids), "greedy_agreement_per_prompt": agreement, "model_path": engine.model_path,
        }
    finally:
        platform = engine.platform
        del llm, engine
        _release(platform)
    result["wall_s"] = clock.total()
    result["phase_s"] = clock.phases
    return result


class _PhaseClock:
    """Seconds per phase of one run (the report's phase_s), and the total."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self.last, 2)
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.start


def config_of(args: EngineArgs) -> dict:
    """The fields that name a configuration in the report."""
    return {k: getattr(args, k) for k in ("model", "quantization", "dtype", "kv_cache_dtype", "int8_activations",
                                          "kv_cache_memory")}


def _check_fits(llm, ids: list[int], what: str) -> None:
    if len(ids) < 2:
        raise ValueError(f"{what} must be at least 2 tokens long, got {len(ids)}")
    if len(ids) >= llm.engine.max_model_len:
        raise ValueError(f"{what} is {len(ids)} tokens, but max_model_len is {llm.engine.max_model_len}")
