"""Offline API: LLM(model=...).generate(prompts, SamplingParams)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jinja2
import torch
from tqdm import tqdm

from pagellm import generation_config as sampling_defaults
from pagellm.chat_template import RESERVED_TEMPLATE_NAMES
from pagellm.config import EngineArgs
from pagellm.engine.embedding import embed
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.scoring import next_token_logprobs
from pagellm.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from pagellm.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | list[int]


class LLM:
    """Every EngineArgs field is a keyword argument: LLM(kv_cache_memory="2GiB", max_num_seqs=32).
    generation_config: where generate/chat without sampling params take their defaults, as vLLM's LLM: "auto"
    the model directory's generation_config.json, "vllm" SamplingParams()'s, or a directory's file."""

    def __init__(self, model: str | None = None, generation_config: str = "auto", **kwargs):
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        if not isinstance(generation_config, str):
            raise TypeError(f"generation_config must be 'auto', 'vllm' or a directory, got "
                            f"{type(generation_config).__name__}")
        # "vllm" or an explicit directory: read (and checked) before the model loads; "auto" needs its path
        defaults = None if generation_config == "auto" else sampling_defaults.load(generation_config, None)
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()
        try:
            self._sampling_defaults = defaults if defaults is not None else \
                sampling_defaults.load("auto", self.engine.model_path)
        except ValueError:  # the model's own generation_config.json is unreadable: no workers left behind
            self.engine.shutdown()
            raise

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use when given no sampling params: the generation config's fields that differ
        from the OpenAI defaults (vLLM's LLM.get_default_sampling_params), else SamplingParams()."""
        return SamplingParams(**self._sampling_defaults)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if prompts is None or isinstance(prompts, (int, float, bytes)) or not hasattr(prompts, "__iter__"):
            raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict or a list of those, got "
                            f"{type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            iterable = hasattr(sampling_params, "__iter__") and not isinstance(sampling_params, (dict, str))
            params = list(sampling_params) if iterable else [sampling_params]
            bad = [p for p in params if not isinstance(p, SamplingParams)]  # a dict iterates its keys
            if bad:  # (a list, not next(..., None): a None in the list is itself the wrong one)
                raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                                f"{type(bad[0]).__name__}")
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                try:
                    ids.append(self.engine.add_request(str(next(self._ids)), prompt, p))
                except (ValueError, TypeError) as e:
                    if len(prompts) == 1:
                        raise
                    kind = TypeError if isinstance(e, TypeError) else ValueError
                    raise kind(f"prompt {i}: {e}") from e  # which one of the batch
        except Exception:
            self.engine.abort_request(ids)  # all or nothing: don't leave half a batch queued
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation rendered by the model's chat template (or `chat_template`, with
        `tools` and `chat_template_kwargs` passed to it), then generated; each output's `prompt` is the
        rendered text."""
        if isinstance(messages, (list, tuple)) and not messages:
            return []
        conversations = [messages] if isinstance(messages, (list, tuple)) and isinstance(messages[0], dict) \
            else messages
        if not isinstance(conversations, (list, tuple)) or any(
                not isinstance(c, (list, tuple)) or not c or any(not isinstance(m, dict) for m in c)
                for c in conversations):
            raise TypeError("messages must be a non-empty list of message dicts ({'role': ..., 'content': ...}), or "
                            "a list of such conversations")
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(set(kwargs) & set(RESERVED_TEMPLATE_NAMES))
        if clash:
            raise ValueError(f"chat_template_kwargs must not set {', '.join(clash)}: pass them as arguments")
        tok = self.engine.tokenizer
        texts = []
        for c in conversations:
            try:
                texts.append(tok.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt,
                                                     tools=tools, continue_final_message=continue_final_message,
                                                     chat_template=chat_template, **kwargs))
            except jinja2.TemplateError as e:  # a message the template cannot render (no 'content', ...)
                raise ValueError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
        outs = self.generate([tok.encode(t, add_special_tokens=False) for t in texts], sampling_params, use_tqdm)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

    def beam_search(self, prompts: Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: per prompt, the params.beam_width best sequences, best first (the engine's
        beam search, transformers' num_beams semantics: pagellm/engine/beam_search.py)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        outs = self.generate(prompts, params.to_sampling_params(), use_tqdm)
        tok = self.engine.tokenizer
        results = []
        for out in outs:
            seqs = []
            for c in out.outputs:
                tokens = out.prompt_token_ids + c.token_ids
                seqs.append(BeamSearchSequence(tokens, cum_logprob=c.cumulative_logprob, finish_reason=c.finish_reason,
                                               stop_reason=c.stop_reason,
                                               text=tok.decode(tokens, skip_special_tokens=False)))
            results.append(BeamSearchOutput(seqs))
        return results

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        pending = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while pending:
                if not self.engine.has_unfinished_requests():  # never spin on an engine with no work
                    raise RuntimeError(f"{len(pending)} request(s) vanished from the engine unfinished")
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        except BaseException:
            self.engine.abort_request(list(pending))
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None,
              normalize: bool = True) -> list[list[float]]:
        """One embedding per prompt: its final hidden state pooled "last" or "mean" (default: the
        engine's embedding_pooling), L2-normalized (pagellm/engine/embedding.py)."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [list(prompts) if isinstance(prompts, tuple) else prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids or a list of those, got "
                            f"{type(prompts).__name__}")
        return [embed(self.engine, p, pooling, normalize)[0] for p in prompts]

    def next_token_logprobs(self, sequences: list[int] | Sequence[list[int]], start: int | Sequence[int] = 0,
                            chunk: int | None = None) -> list[torch.Tensor]:
        """Teacher forcing: per token-id sequence, float32 full-vocabulary log-softmax rows
        [len - start, vocab], row i the distribution of the token after seq[:start + i + 1], from the
        engine's forward in chunks of `chunk` rows (default: the step budget; pagellm/engine/scoring.py)."""
        def ids(s) -> bool:  # a sequence of token ids, not text
            return isinstance(s, Sequence) and not isinstance(s, (str, bytes))

        if ids(sequences) and sequences and isinstance(sequences[0], int):
            sequences = [sequences]
        if not ids(sequences) or not all(ids(s) for s in sequences):
            raise TypeError("sequences must be a list of token ids or a list of those (text is not scored here: "
                            "encode it with llm.get_tokenizer() first)")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk must be an integer >= 1, got {chunk!r}")
        starts = [start] * len(sequences) if isinstance(start, int) else list(start)
        if len(starts) != len(sequences):
            raise ValueError(f"got {len(starts)} starts for {len(sequences)} sequences")
        return [next_token_logprobs(self.engine, s, st, chunk) for s, st in zip(sequences, starts, strict=True)]

    def shutdown(self) -> None:
        """Stops tensor/pipeline-parallel worker processes now (else they stop with this object or process)."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()
