"""`pagellm plan`: will this model fit, how many sequences, and on how many ranks (see memory.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagellm.config import KV_CACHE_DTYPES, check_block_size, parse_bytes
from pagellm.model_config import ModelConfig
from pagellm.plan.memory import MemoryPlan, plan_memory, smallest_parallelism
from pagellm.plan.presets import ARCHITECTURES, GPUS, preset_config

DTYPES = ("float32", "float16", "bfloat16")


def parse_size(text: str) -> int:
    """80GB, 141e9, 24GiB -> bytes (GB decimal, GiB binary): the engine's own parser (--kv-cache-memory)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise ValueError(f"--device-memory: {e}") from None


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_model(model: str) -> ModelConfig:
    """A preset name, a config.json directory or a GGUF file -> its config."""
    if model in ARCHITECTURES:
        return preset_config(model)
    from pagellm.model.loader import load_config

    if not os.path.exists(model):
        raise ValueError(f"--model {model!r} is neither a preset ({', '.join(sorted(ARCHITECTURES))}) nor a "
                         "local GGUF file or model directory")
    return load_config(model)


def checkpoint_weight_bytes(model: str, cfg: ModelConfig, dtype: str, quantization: str | None,
                            cpu: bool) -> int | None:
    """What the engine holds for a real checkpoint's weights (plan/weights.py), None for a preset (whose
    --quantization is a what-if); refuses what the engine refuses. cpu: the CPU engine, whose native kernels
    read the blocks at float32; else a CUDA engine's dequantized weights."""
    if model in ARCHITECTURES:
        return None
    from pagellm.model.loader import is_gguf_path
    from pagellm.plan.weights import gguf_weight_bytes, hf_weight_bytes

    if cpu and dtype == "float16":
        raise ValueError("--cpu --dtype float16: the CPU engine computes in float32 or bfloat16")
    blocks = cpu and dtype == "float32"

    if quantization == "fp8":
        raise ValueError(f"--quantization fp8: the engine quantizes a float checkpoint at load to int8 or int4 "
                         f"only; an FP8 checkpoint is planned from its own quantization_config ({model})")
    if is_gguf_path(model):
        if quantization:
            raise ValueError(f"--quantization {quantization} quantizes a float Hugging Face checkpoint; {model} is "
                             "a GGUF, whose weights are quantized already")
        return gguf_weight_bytes(model, cfg, dtype, blocks=blocks)
    if quantization and cfg.weight_format:
        raise ValueError(f"--quantization {quantization} quantizes a float checkpoint; {model} is quantized "
                         f"already (quant_method {cfg.weight_format!r})")
    if quantization and not blocks:
        print(f"note: without block kernels (a GPU; a CPU at {dtype}) the engine computes --quantization "
              f"{quantization} weights in {dtype} and keeps their blocks beside them", file=sys.stderr)
    return hf_weight_bytes(model, cfg, dtype, blocks, quantization)


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="memory plan: weights, KV cache and batch per rank before deploying",
                       description="Plan a deployment's memory without loading weights: weights and KV bytes "
                                   "per rank, KV blocks and tokens that fit, the largest batch at max_model_len, "
                                   "and whether it fits (or the smallest TP x PP that would). Exit status: 0 "
                                   "when it fits, 1 when it does not (the plan is printed either way), 2 for "
                                   "bad options.")
    p.add_argument("--model", required=True, help=f"a preset ({', '.join(sorted(ARCHITECTURES))}), a .gguf file "
                                                  "or a Hugging Face config.json directory")
    p.add_argument("-tp", "--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("-pp", "--pp", "--pipeline-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--dtype", default=None, choices=DTYPES, help="weights and activations (default: bfloat16 on "
                                                                "a GPU, float32 with --cpu)")
    p.add_argument("--quantization", default=None, choices=["int8", "fp8", "int4"],
                   help="weights quantized at load (--quantization of the engine; fp8: presets only, a what-if). "
                        "A GGUF file or a quantized checkpoint is planned as the engine holds it: blocks with "
                        "--cpu (the native kernels read them), dequantized to --dtype on a GPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    p.add_argument("--kv-heads", type=int, default=None, help="override the KV head count (what-if: MHA vs GQA)")
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=1, help="sequences that must fit at max_model_len")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="rows of one step (workspace)")
    p.add_argument("--block-size", type=int, default=16)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--device-memory", help="memory of one device, e.g. 80GB or 24GiB")
    where.add_argument("--gpu", choices=sorted(GPUS), help="a GPU preset (marketed decimal GB)")
    where.add_argument("--cpu", action="store_true", help="this host's RAM")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of the device to use")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_plan)


def run_plan(ns: argparse.Namespace) -> int:
    cfg = load_model(ns.model)
    if ns.kv_heads is not None:
        if ns.kv_heads < 1 or cfg.num_attention_heads % ns.kv_heads:
            raise ValueError(f"--kv-heads {ns.kv_heads} must divide the {cfg.num_attention_heads} attention heads")
        cfg.num_key_value_heads = ns.kv_heads
    if ns.cpu:
        device, label = host_memory_bytes(), "cpu"
    else:
        device = GPUS[ns.gpu] if ns.gpu else parse_size(ns.device_memory)
        label = ns.gpu or f"{device / 1e9:.1f} GB"
    dtype = ns.dtype or ("float32" if ns.cpu else "bfloat16")
    held = checkpoint_weight_bytes(ns.model, cfg, dtype, ns.quantization, ns.cpu)
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    check_block_size(ns.block_size, "--block-size")  # what the engine takes, so a plan is one it can run
    context = cfg.max_position_embeddings
    if ns.max_model_len is not None and ns.max_model_len > context:
        print(f"note: --max-model-len {ns.max_model_len} is longer than the model's context ({context} tokens): "
              f"the engine refuses it where the KV cache holds fewer tokens, else runs {context}", file=sys.stderr)

    def plan(tp: int, pp: int) -> MemoryPlan:
        def at(max_len: int | None) -> MemoryPlan:
            return plan_memory(cfg, ns.model, device, tp, pp, dtype, ns.kv_cache_dtype, ns.quantization, max_len,
                               ns.max_num_seqs, ns.block_size, ns.max_num_batched_tokens, ns.gpu_memory_utilization,
                               held)

        asked = at(ns.max_model_len)  # engine/kv_sizing.fit_max_model_len: the length asked must fit first,
        return at(context) if asked.fits and asked.max_model_len > context else asked  # then it runs the context

    result = plan(ns.tp, ns.pp)
    smallest = None if result.fits else smallest_parallelism(plan)
    if ns.json:
        print(json.dumps({**result.to_dict(), "device": label,
                          "smallest_fitting": None if smallest is None else {"tp": smallest[0], "pp": smallest[1]}},
                         indent=2))
    else:
        print(format_plan(result, label, smallest))
    return 0 if result.fits else 1  # as diff and grep: scripts can test the answer


def format_plan(r: MemoryPlan, label: str, smallest: tuple[int, int] | None) -> str:
    gb, kv = 1e9, r.kv_cache_bytes_per_rank  # (negative where the weights alone do not fit)
    lines = [
        f"model {r.model}: TP {r.tensor_parallel_size} x PP {r.pipeline_parallel_size} on {label} "
        f"({r.device_bytes / gb:.1f} GB, utilization {r.gpu_memory_utilization:.2f}), {r.dtype} weights, "
        f"{r.kv_cache_dtype} KV",
        f"  weights per rank        {r.weights_bytes_per_rank / gb:10.3f} GB",
        f"  workspace per rank      {r.workspace_bytes_per_rank / gb:10.3f} GB (estimate)",
        f"  KV cache per rank       {max(kv, 0) / gb:10.3f} GB"
        + ("" if kv >= 0 else f" (weights and workspace exceed the budget by {-kv / gb:.3f} GB)"),
        f"  KV per token per rank   {r.kv_bytes_per_token_per_rank:10d} bytes",
        f"  KV per sequence         {r.kv_bytes_per_sequence / gb:10.3f} GB ({r.max_model_len} tokens)",
        f"  KV blocks / tokens      {r.kv_blocks:10d} / {r.kv_tokens} (block {r.block_size})",
        f"  largest batch at {r.max_model_len} tokens: {r.max_batch_at_max_model_len}",
        f"  fits: {'yes' if r.fits else 'no'} ({r.reason})",
    ]
    if not r.fits:
        lines.append("  smallest TP x PP that fits: " + (f"TP {smallest[0]} x PP {smallest[1]}" if smallest
                                                         else "none up to 64 ranks"))
    return "\n".join(lines)


__all__ = ["add_plan_parser", "checkpoint_weight_bytes", "format_plan", "load_model", "parse_size", "run_plan"]
