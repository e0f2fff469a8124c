"""get_model: config + weights + platform -> a model ready to run (weights final, ops bound)."""

from __future__ import annotations

import logging

import torch

from pagellm.model.layers.custom_op import CustomOp
from pagellm.model.layers.linear import Linear
from pagellm.model.layers.rotary import RotaryEmbedding
from pagellm.model.loader import is_gguf_path, iter_weights
from pagellm.model.models.llama import MODEL_REGISTRY
from pagellm.model_config import ModelConfig
from pagellm.platforms import Platform
from pagellm.quant import rtn

logger = logging.getLogger(__name__)


def get_model(path: str, cfg: ModelConfig, platform: Platform, dtype: torch.dtype, device: torch.device | None = None,
              int8_activations: bool | None = None, packed_weights_only: bool = True,
              auto_dtype: bool = False, quantization: str = "auto",
              quantization_group_size: int = 128) -> torch.nn.Module:
    """Builds the architecture on the meta device, materialises it on `device`, streams the weights in and
    lets the platform choose each op's implementation.

    packed_weights_only: keep quantized matrices only in their GGUF block form where the platform's kernels
    read them (each float copy is freed as soon as its packed twin has arrived; the tied embedding's at the
    end, its lookups then read rows of the packed LM head). auto_dtype: `--dtype auto` was asked for, so
    the platform may choose non-exact faster paths (bf16 many-row GEMMs). quantization: --quantization
    (pagellm.config.QUANTIZATIONS): auto follows the checkpoint; gptq/awq/fp8/compressed-tensors must match
    its quantization_config; "none" computes with the dequantized float weights only; int8/int4 quantize a
    float checkpoint's matrices at load (pagellm.quant.rtn, int4 in groups of quantization_group_size), the
    tied LM head included."""
    if quantization in rtn.RTN_QUANTIZATIONS:
        _check_float_checkpoint(path, cfg, quantization)
    arch = cfg.architecture
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r} (supported: {sorted(MODEL_REGISTRY)})")
    device = device or platform.device
    choices = platform.op_choices(dtype, int8_activations, packed_weights_only, auto=auto_dtype)
    with torch.device("meta"):
        model = MODEL_REGISTRY[arch](cfg)
    model = model.to_empty(device=device).to(dtype)
    # Buffers computed at init were lost on the meta device; rebuild them for real.
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                   cfg.rope_scaling).to(device)
    for m in model.modules():
        if isinstance(m, Linear):
            m.configure(choices)
    with platform.loading():
        # Packed (GGUF block) copies only where the kernels will read them.
        source_format = "auto" if quantization in rtn.RTN_QUANTIZATIONS else quantization
        model.load_weights(iter_weights(path, cfg, dtype, packed=choices.packed_kernels and quantization != "none",
                                        quantization=source_format))
        if quantization in rtn.RTN_QUANTIZATIONS:
            for name, m in model.named_modules():
                if isinstance(m, Linear):
                    rtn.quantize_linear(m, name, quantization, quantization_group_size)
            if cfg.tie_word_embeddings and not choices.packed_weights_only:  # lookups see the head's values
                model.embed_tokens.weight.data.copy_(model.lm_head.packed.dequantize())
        if cfg.tie_word_embeddings and choices.packed_weights_only and model.lm_head.packed is not None:
            emb = model.embed_tokens  # (the head's own float copy went in load_weights)
            emb.weight.data = torch.empty(0, emb.weight.shape[1], dtype=emb.weight.dtype)
            emb.tied_head = model.lm_head
    int8_prompt_rows_in_every_layer_or_none(model)
    for m in model.modules():
        if isinstance(m, CustomOp):
            m.use(choices.op_impl)
    return model.eval()


def int8_prompt_rows_in_every_layer_or_none(model: torch.nn.Module) -> None:
    """On AVX2 (OpChoices.int8_many_rows without bf16 GEMMs), one-plane int8 prompt rows stay only where every layer a
    prompt's rows pass through takes them. A layer of another kind (a GGUF mix's Q6_K pieces, q8_0, a float
    checkpoint) picks its float32 path by the rows in the step (few-row kernels or OpenBLAS), and int8's rounding in
    the layers after it turns those float32-level differences between two chunkings of a prompt into steps of 1/127
    of a block's largest value: a Q4_K_M-like tiny model's prompt logprobs moved up to 0.09 nats with the chunk budget
    under the AVX2 cap, 0.0014 with every layer on float32 (forty-first session), and speculation would part from
    plain decoding. The logits head feeds no other layer. Otherwise every layer goes back to float32: the runner then
    marks no prompts. Again after a tensor-parallel cut (parallel.shard_model), which the tile order may not take.
    With bf16 GEMMs (AVX-512 BF16) the other layers' paths differ at bf16 level by the rows (two-plane int8 or bf16),
    and int8 prompt rows in the q4_1 layers halve what a chunking moves there (0.22 against 0.66 nats, the same
    probe): they stay."""
    from dataclasses import replace

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    choices = layers[0].quant_method.choices if layers else None
    if choices is None or not choices.int8_many_rows or choices.bf16_gemm:
        return
    others = sum(not m.quant_method.int8_many(m) for m in layers if not m.logits_head)
    if not others:
        return
    logger.info("one-plane int8 prompt rows off: %d of %d layers take another path", others,
                sum(not m.logits_head for m in layers))
    off = replace(choices, int8_many_rows=False)
    for m in layers:
        m.quant_method.choices = off
        m.int8_tiles = None  # kept for prompt rows alone


def _check_float_checkpoint(path: str, cfg: ModelConfig, quantization: str) -> None:
    """int8/int4 at load quantize float weights; a checkpoint that is quantized already is refused (its format
    is `cfg.weight_format`, from config.json or an old quantize_config.json)."""
    if is_gguf_path(path):
        raise ValueError(f"--quantization {quantization} quantizes a float Hugging Face checkpoint; {path} is a "
                         "GGUF, whose weights are quantized already (use --quantization auto or none)")
    if cfg.weight_format:
        raise ValueError(f"--quantization {quantization} quantizes a float checkpoint; {path} says it is "
                         f"quantized already (quant_method {cfg.weight_format!r}; use --quantization auto)")


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter plus every other copy of a weight a layer keeps: GGUF blocks, bf16 GEMM copies,
    blocks in AMX / vdpbf16ps tile order and in int8 tile order (auto on an AVX-512 BF16 CPU keeps all four)."""
    copies = ("packed", "weight_bf16", "amx_blocks", "int8_tiles")
    extra = [t for m in model.modules() for t in (getattr(m, a, None) for a in copies) if t is not None]
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        t.nbytes for t in extra)
