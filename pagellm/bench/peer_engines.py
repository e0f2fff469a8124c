"""The engines `pagellm bench ... --peer` compares, each driven the same way inside its own child process
(see `pagellm.bench.peers`): load and warm up, then `throughput(requests)` or `latency(prompts, output_len)`.

Every engine gets token ids (never text), decodes greedily and ignores EOS, so all of them do exactly the
same work. Imports are lazy and per engine: the llama.cpp child must not import torch, or its peak RSS
would include torch's.
"""

from __future__ import annotations

import os
import time

from pagellm.bench.workload import BenchRequest


class PeerUnavailable(Exception):
    """The engine cannot run here (not installed, unsupported model): skipped with a one-line message."""


class PagellmEngine:
    def __init__(self, spec: dict):
        from pagellm import LLM
        from pagellm.quant.kv_cache import kv_dtype_label

        self.llm = LLM(**dict(spec["engine_args"], num_threads=spec["threads"]))
        eng = self.llm.engine
        spec_method = eng.args.speculative_method
        self.method = ("continuous batching (pagellm LLMEngine), greedy, ignore_eos"
                       + (f", {spec_method} speculative decoding" if spec_method else ""))
        self.info = {"kv_bytes_per_token": eng.bytes_per_block // eng.kv_cache.block_size,
                     "kv_cache_bytes": eng.bytes_per_block * eng.kv_cache.num_blocks,
                     "kv_cache_prefault": eng.args.prefault_kv_cache,
                     "dtype": ("auto -> " if eng.args.dtype == "auto" else "") + kv_dtype_label(eng.dtype)
                     + f", KV {kv_dtype_label(eng.kv_dtype)}"}

    def warm_up(self, prompt: list[int]) -> None:
        from pagellm.bench.throughput import warm_up_pagellm

        warm_up_pagellm(self.llm, [prompt])

    def throughput(self, requests: list[BenchRequest]) -> dict:
        from pagellm.bench.throughput import run_pagellm_throughput

        # Other engines start every run with an empty cache; so does pagellm (the warm-up cached a prompt).
        self.llm.reset_prefix_cache()
        res = run_pagellm_throughput(self.llm, requests, warm_up=False)
        return {"elapsed_s": res["elapsed_s"], "generated_tokens": res["output_tokens"]}

    def latency(self, prompts: list[list[int]], output_len: int) -> dict:
        from pagellm.bench.common import timed_latency_run

        self.llm.reset_prefix_cache()  # a fair TTFT: no run reuses the previous run's prompt blocks
        return timed_latency_run(self.llm, prompts, output_len, ignore_eos=True)


class TransformersEngine:
    def __init__(self, spec: dict):
        try:
            import torch
            import transformers
        except ImportError as e:
            raise PeerUnavailable(f"transformers is not installed ({e}); install it with: make peers") from None
        from transformers import AutoModelForCausalLM

        from pagellm.model.loader import is_gguf_path

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        torch.set_num_threads(spec["threads"])
        self.torch = torch
        dt = spec.get("peer_dtype") or "float32"
        dtype = getattr(torch, dt)
        path = spec["model"]
        if is_gguf_path(path):  # transformers dequantizes the GGUF's weights into `dtype`
            kw = {"gguf_file": os.path.basename(path)}
            path = os.path.dirname(path)
        else:
            kw = {}
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()
        # ignore_eos: with no EOS id nothing stops early, so every row gets exactly max_new_tokens and greedy
        # picks the same tokens as pagellm's ignore_eos (min_new_tokens would ban EOS and change them).
        # Set on the model's own config because generate() fills unset kwargs back in from it.
        self.model.generation_config.eos_token_id = None
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self.batch_size = spec.get("peer_batch_size", 16)
        if spec["mode"] == "throughput":
            self.method = (f"generate() in static batches of {self.batch_size} in workload order, left-padded, "
                           "greedy, no EOS; each batch runs to its longest output_len and only each request's "
                           f"own output_len tokens are counted ({dt})")
        else:
            self.method = f"generate() on the whole batch at once, greedy, no EOS, steps timed by a streamer ({dt})"
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.info = {"dtype": dt, "transformers": transformers.__version__,  # DynamicCache: K and V in `dtype`
                     "kv_bytes_per_token": 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * dtype.itemsize}

    def _generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[float], list[list[int]]]:
        """Left-padded greedy generate; returns the time of every decoding step and each row's new ids."""
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        steps = _StepTimes()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=self.pad_id, streamer=steps, num_beams=1)
        new = out[:, width:].tolist()
        if len(steps.times) != new_tokens or any(len(r) != new_tokens for r in new):
            raise RuntimeError(f"transformers made {len(steps.times)} steps, {new_tokens} asked for")
        return steps.times, new

    def warm_up(self, prompt: list[int]) -> None:
        self._generate([prompt], 4)

    def throughput(self, requests: list[BenchRequest]) -> dict:
        t0 = time.perf_counter()
        generated = 0
        for i in range(0, len(requests), self.batch_size):
            batch = requests[i:i + self.batch_size]
            longest = max(r.output_len for r in batch)
            self._generate([r.prompt_token_ids for r in batch], longest)
            generated += longest * len(batch)
        return {"elapsed_s": time.perf_counter() - t0, "generated_tokens": generated}

    def latency(self, prompts: list[list[int]], output_len: int) -> dict:
        t0 = time.perf_counter()
        times, new = self._generate(prompts, output_len)
        return latency_result(t0, times[0], times[-1], new)


class _StepTimes:
    """generate()'s streamer: put() gets the prompt first, then each step's new tokens (one per row)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def latency_result(t0: float, first: float, end: float, new: list[list[int]]) -> dict:
    """Same definitions as pagellm's `timed_latency_run`: TTFT from submission to the first token; decode tok/s
    counts the tokens after each row's first one, over the time after the first token."""
    n_out = sum(len(r) for r in new)
    return {"ttft_s": first - t0, "decode_tok_s": (n_out - len(new)) / max(end - first, 1e-9),
            "output_tokens": n_out, "token_ids": new}


class LlamaCppEngine:
    """llama.cpp through llama-cpp-python's low-level C API: one llama_batch per step holds every running
    sequence's next token plus chunks of waiting prompts (its own seq id each, like llama.cpp's `parallel`
    example), so throughput runs requests concurrently, as pagellm does."""

    def __init__(self, spec: dict):
        from pagellm.model.loader import is_gguf_path

        if not is_gguf_path(spec["model"]):
            raise PeerUnavailable(f"llama.cpp needs a .gguf model; {spec['model']} is not one")
        try:
            import llama_cpp
        except ImportError as e:
            raise PeerUnavailable(f"llama_cpp is not installed ({e}); install it with: make peers") from None
        import numpy as np

        self.lc, self.np = llama_cpp, np
        if spec["mode"] == "throughput":
            reqs, widest = spec["requests"], len(spec["requests"])
        else:
            reqs = [[p, spec["output_len"]] for b in spec["batches"] for p in b["prompts"]]
            widest = max(len(b["prompts"]) for b in spec["batches"])
        self.parallel = max(1, min(spec.get("peer_parallel", 64), widest, llama_cpp.llama_max_parallel_sequences()))
        self.n_batch = 512  # tokens per llama_decode call (llama.cpp's default n_batch and n_ubatch)
        # Built with the C API rather than llama_cpp.Llama, whose constructor cannot set n_seq_max.
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(spec["model"].encode(),
                                                          llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {spec['model']}")
        cp = llama_cpp.llama_context_default_params()
        # Not unified: each sequence gets its own n_ctx / n_seq_max cells and attends only to them
        # (faster when prompts share nothing), so every slot must fit the longest request.
        cp.n_seq_max, cp.kv_unified = self.parallel, False
        cp.n_ctx = self.parallel * (max(len(p) + n for p, n in reqs) + 8)
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_threads = cp.n_threads_batch = spec["threads"]
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.method = (f"llama.cpp C API: one llama_batch per step, up to {self.parallel} sequences at once "
                       f"(n_seq_max, KV not unified), {self.n_batch}-token batches, greedy argmax, no EOS; "
                       "GGUF weights as stored")
        m = self.model
        head_dim = llama_cpp.llama_model_n_embd(m) // llama_cpp.llama_model_n_head(m)
        self.info = {"llama_cpp": getattr(llama_cpp, "__version__", "?"), "n_ctx": llama_cpp.llama_n_ctx(self.ctx),
                     # K and V in f16, llama.cpp's default cache type
                     "kv_bytes_per_token": 2 * llama_cpp.llama_model_n_layer(m) * llama_cpp.llama_model_n_head_kv(m)
                     * head_dim * 2, "dtype": "GGUF weights, f16 KV cache"}

    def _clear(self, seq_id: int = -1) -> None:
        lc = self.lc
        if hasattr(lc, "llama_get_memory"):
            lc.llama_memory_seq_rm(lc.llama_get_memory(self.ctx), seq_id, -1, -1)
        else:  # llama-cpp-python before the llama_memory API
            lc.llama_kv_self_seq_rm(self.ctx, seq_id, -1, -1)

    def _run(self, requests: list[tuple[list[int], int]]) -> tuple[float, list[float], list[list[int]]]:
        """Greedy-decode every (prompt, output_len) with up to `parallel` in flight; returns the start time,
        each request's first-token time and its output ids."""
        lc, np = self.lc, self.np
        self._clear()
        queue = list(range(len(requests)))[::-1]
        slots: dict[int, dict] = {}  # seq id -> {"req", "pos" (tokens in the KV cache), "next"}
        free = list(range(self.parallel))[::-1]
        outs: list[list[int]] = [[] for _ in requests]
        first = [0.0] * len(requests)
        t0 = time.perf_counter()
        while queue or slots:
            while queue and free:
                slots[free.pop()] = {"req": queue.pop(), "pos": 0}
            b, n, sample_at = self.batch, 0, []
            for sid, s in slots.items():  # running sequences: one token each
                if "next" in s:
                    n = self._add(b, n, s["next"], s["pos"], sid, True)
                    s["pos"] += 1
                    sample_at.append((n - 1, sid))
            for sid, s in slots.items():  # then prompt chunks, in whatever room is left
                prompt = requests[s["req"]][0]
                while "next" not in s and s["pos"] < len(prompt) and n < self.n_batch:
                    last = s["pos"] == len(prompt) - 1
                    n = self._add(b, n, prompt[s["pos"]], s["pos"], sid, last)
                    s["pos"] += 1
                    if last:
                        sample_at.append((n - 1, sid))
            b.n_tokens = n
            if lc.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            now = time.perf_counter()
            for i, sid in sample_at:
                s = slots[sid]
                tok = int(np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())
                out = outs[s["req"]]
                if not out:
                    first[s["req"]] = now
                out.append(tok)
                s["next"] = tok
                if len(out) == requests[s["req"]][1]:  # done: free the slot and its KV cells
                    self._clear(sid)
                    del slots[sid]
                    free.append(sid)
        return t0, first, outs

    @staticmethod
    def _add(b, n: int, token: int, pos: int, seq_id: int, logits: bool) -> int:
        b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, logits
        b.seq_id[n][0] = seq_id
        return n + 1

    def warm_up(self, prompt: list[int]) -> None:
        self._run([(prompt, 4)])

    def throughput(self, requests: list[BenchRequest]) -> dict:
        t0 = time.perf_counter()
        _, _, outs = self._run([(r.prompt_token_ids, r.output_len) for r in requests])
        generated = sum(len(o) for o in outs)
        return {"elapsed_s": time.perf_counter() - t0, "generated_tokens": generated}

    def latency(self, prompts: list[list[int]], output_len: int) -> dict:
        t0, first, outs = self._run([(p, output_len) for p in prompts])
        res = latency_result(t0, min(first), time.perf_counter(), outs)
        res["ttft_s"] = sum(f - t0 for f in first) / len(first)  # mean over requests, as pagellm's
        return res


def _vllm_engine(spec: dict):
    from pagellm.bench.peer_vllm import VllmEngine  # runs under vLLM's Python (see peer_vllm)

    return VllmEngine(spec)


ENGINES = {"pagellm": PagellmEngine, "transformers": TransformersEngine, "llama.cpp": LlamaCppEngine,
           "vllm": _vllm_engine}
