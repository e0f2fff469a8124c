"""What LLMEngine builds from EngineArgs next to the model: the bytes of one KV block, the KV cache's element
type, and the speculative proposer (n-gram, or a draft model with its own runner and KV cache)."""

from __future__ import annotations

import logging

import torch

from pagellm.config import EngineArgs, parse_bytes
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.executor.uniproc import UniprocExecutor
from pagellm.model.attention import AttentionBackend
from pagellm.model.loader import load_config, resolve_model_path
from pagellm.model.loader.model_loader import get_model, model_weight_bytes
from pagellm.model.runner import ModelRunner
from pagellm.model_config import ModelConfig
from pagellm.plan import kv_bytes_per_token
from pagellm.platforms import Platform
from pagellm.platforms.base import DTYPES
from pagellm.quant.kv_cache import KV_QUANT_DTYPES, kv_dtype_label
from pagellm.sample import Sampler
from pagellm.spec_decode.proposers import DraftModelProposer, NgramProposer

logger = logging.getLogger("pagellm")


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp: int = 1, pp: int = 1) -> int:
    """K and V of block_size tokens for every layer and KV head of the busiest rank (docs/architecture.md,
    "Memory"); an int8 row carries its 2-byte scale (pagellm/quant/kv_cache.py)."""
    return kv_bytes_per_token(cfg, kv_dtype_label(dtype), tp, pp) * block_size


def resolve_kv_dtype(args: EngineArgs, dtype: torch.dtype, platform: Platform) -> torch.dtype:
    """The KV cache element type: `auto` follows the compute dtype (under `--dtype auto`, the platform's
    choice); int8 / fp8 (= fp8_e4m3) / fp8_e5m2 quantize on write and are read by every attention backend."""
    name = args.kv_dtype_name
    if name in KV_QUANT_DTYPES:
        return KV_QUANT_DTYPES[name]
    if name == "auto":  # both auto
        return platform.auto_kv_dtype(dtype)
    return DTYPES[name]


def build_proposer(args: EngineArgs, max_model_len: int, backend: AttentionBackend, sampler: Sampler,
                   cfg: ModelConfig, platform: Platform, dtype: torch.dtype, device: torch.device):
    if args.speculative_method is None:
        return None
    if args.speculative_method == "ngram":
        return NgramProposer(args.num_speculative_tokens, max_model_len, args.ngram_min, args.ngram_max)
    if not args.draft_model:
        raise ValueError("speculative_method='draft' needs draft_model (a .gguf file or HF directory)")
    path = resolve_model_path(args.draft_model)
    draft_cfg = load_config(path)
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft_cfg.vocab_size}) differs from the target's "
                         f"({cfg.vocab_size})")
    kv_dtype = resolve_kv_dtype(args, dtype, platform)
    # blocks only where the kernels read them, as the target (float copies beside them had made a SmolLM2 draft
    # hold 619 MiB against the target's 106: a probe)
    draft = get_model(path, draft_cfg, platform, dtype, device)
    per_block = kv_bytes_per_block(draft_cfg, args.block_size, kv_dtype)
    num_blocks = parse_bytes(args.draft_kv_cache_memory) // per_block
    if num_blocks < 1:
        raise ValueError(f"draft_kv_cache_memory ({args.draft_kv_cache_memory}) holds no KV block of the draft model "
                         f"({per_block} bytes at block size {args.block_size}): raise --draft-kv-cache-memory")
    runner = ModelRunner(draft, num_blocks, args.block_size, kv_dtype, device, backend, platform,
                         prefault_kv=args.prefault_kv_cache)
    logger.info("draft model %s: %d layers, weights %.1f MiB, %d KV blocks (%.1f MiB)", path,
                draft_cfg.num_hidden_layers, model_weight_bytes(draft) / 2**20, num_blocks,
                num_blocks * per_block / 2**20)
    return DraftModelProposer(UniprocExecutor(runner), sampler, KVCacheManager(num_blocks, args.block_size),
                              args.num_speculative_tokens, max_model_len)
