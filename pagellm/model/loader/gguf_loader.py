"""GGUF -> ModelConfig and a stream of Hugging Face-named, dequantized tensors."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagellm.model.loader.gguf_reader import GGUFFile
from pagellm.model_config import ModelConfig
from pagellm.quant.formats import PACKED_SUFFIX, PackedWeight
from pagellm.quant.gguf_blocks import PACKERS, pack_gguf_tensor

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Derived at load time from the config, not model parameters.
_SKIPPED = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name!r} "
                         "(pagellm loads dense llama/mistral/qwen2 models)")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _blocks(raw: np.ndarray, block_bytes: int) -> torch.Tensor:
    # Copy out of the read-only mmap: torch wants writable memory and the bytes are small (quantized).
    return torch.from_numpy(np.array(raw, copy=True)).reshape(-1, block_bytes)


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    return b[:, start:start + 2].contiguous().view(torch.float16).float()


def _q8_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 34)
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _q4_0(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 18)
    qs = b[:, 2:]
    return (torch.cat([qs & 15, qs >> 4], dim=1).float() - 8) * _f16(b, 0)


def _q4_1(raw: np.ndarray) -> torch.Tensor:
    b = _blocks(raw, 20)
    qs = b[:, 4:]
    return torch.cat([qs & 15, qs >> 4], dim=1).float() * _f16(b, 0) + _f16(b, 2)


# gguf.quants does these in single-threaded numpy at ~5x the cost; they are the common formats of small
# models, so they get torch fast paths (tests check them bit-exact against gguf.quants).
_FAST = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1}
# Types kept in block form (pagellm/quant/gguf_blocks.py maps each exactly onto a PackedWeight kind); the
# others (IQ*, TQ*, MXFP4, ...) are dequantized to float at load.
_PACKABLE = frozenset(Q[name] for name in PACKERS)
_PLAIN = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def dequantize_tensor(gf: GGUFFile, name: str) -> torch.Tensor:
    """The tensor in its GGUF (numpy-order) shape, as float32 (or its stored float dtype)."""
    info = gf.tensors[name]
    raw = gf.raw(name)
    if info.qtype in _PLAIN:
        out = torch.from_numpy(np.array(raw, copy=True)).view(_PLAIN[info.qtype])
    elif info.qtype in _FAST:
        out = _FAST[info.qtype](raw)
    else:
        try:
            out = torch.from_numpy(dequantize(raw, info.qtype))
        except NotImplementedError as e:
            raise ValueError(f"{name}: GGUF tensor type {info.qtype.name} is not supported") from e
    return out.reshape(info.shape)


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time row permutation of Q/K (interleaved -> HF's half-split rotary)."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str, config: ModelConfig, dtype: torch.dtype,
                      packed: bool = False) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """Dequantize tensor by tensor. torch runs single-threaded until the stream is exhausted or closed.

    With packed=True, every matrix of a type in _PACKABLE is also yielded in its block form, named
    `<hf name>` + PACKED_SUFFIX, right after its dequantized self (see pagellm/quant/formats.py)."""
    gf = GGUFFile(path)
    # llama.cpp's llama converter (also used for Mistral) permutes Q/K rows; its qwen2 converter does not.
    permuted = gf.architecture in ("llama", "mistral")

    def load(name: str) -> list[tuple[str, torch.Tensor | PackedWeight]]:
        w = dequantize_tensor(gf, name)
        heads = None
        if permuted and ".attn_q." in name:
            heads = config.num_attention_heads
        elif permuted and ".attn_k." in name:
            heads = config.num_key_value_heads
        if heads:
            w = unpermute_rotary(w, heads)
        out = [(hf_name(name), w.to(dtype).contiguous())]
        qtype = gf.tensors[name].qtype
        if packed and qtype in _PACKABLE and w.ndim == 2 and w.shape[1] % 32 == 0:
            pw = pack_gguf_tensor(qtype.name, gf.raw(name), tuple(w.shape), name)
            if heads:
                pw = pw.rows(unpermute_rotary(torch.arange(w.shape[0]), heads))
            out.append((hf_name(name) + PACKED_SUFFIX, pw))
        return out

    names = [n for n in gf.tensors if n not in _SKIPPED]
    for n in names:
        hf_name(n)  # fail on an unsupported tensor before spending time dequantizing
    # Elementwise dequant is memory-bound: intra-op OpenMP threads gain little and spin badly when the
    # cores are shared (10x slower under load), so use one thread per op and spread tensors over threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for pairs in _prefetch_map(load, names, workers=min(4, threads)):
            yield from pairs
    finally:
        torch.set_num_threads(threads)


def _prefetch_map(fn: Callable, items: Iterable, workers: int) -> Iterator:
    """map(fn, items) in order, with at most 2 * workers results in flight (bounds peak memory)."""
    if workers <= 1:
        yield from map(fn, items)
        return
    it = iter(items)
    with ThreadPoolExecutor(workers, thread_name_prefix="gguf-dequant") as pool:
        pending = deque(pool.submit(fn, x) for _, x in zip(range(2 * workers), it, strict=False))
        while pending:
            result = pending.popleft().result()
            for x in it:
                pending.append(pool.submit(fn, x))
                break
            yield result
