"""Roofline floors next to the bench figures (issue #4: "stay within 2x of the roofline").

A figure cannot beat what the machine can move or compute: a decode step has to stream every weight it
uses, plus its requests' KV, from memory, and any step has to do its matmul FLOPs. Dividing those by what
this machine measurably sustains (the faster of an fp32 and a bf16 GEMM: on a CPU with AVX-512 BF16 or
AMX the bf16 one, 4.3-4.5x fp32 on the Zen 5 VM; a 256 MiB read or copy) gives the fastest a figure
could be; measured/floor says how close an engine gets (1.0 = at the roofline, >= 0.5 = within 2x).
Integer products are not measured: where an engine multiplies prompt rows on int8 (pagellm under auto on AVX2,
vpmaddubsw at ~1.6-2x OpenBLAS's sgemm), its figure can reach or pass this float floor.

The FLOP counts are the model's matmuls only (norms, rotary and sampling are a few percent at most), so
the floors are optimistic, as a floor should be. torch is imported lazily: the llama.cpp peer child
imports this module and must stay torch-free.
"""

from __future__ import annotations

import statistics
import time

# A prefill-like GEMM: [tokens, hidden] x [hidden, intermediate] at SmolLM2-135M's sizes.
GEMM_SHAPE = (1024, 576, 3072)
STREAM_BYTES = 256 * 2**20  # far beyond any last-level cache, so this is DRAM bandwidth


def _median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def significant(x: float, digits: int = 3) -> float:
    """Significant digits, not decimals: a ratio on a tiny model can be 0.001."""
    return float(f"{x:.{digits}g}")


def measure_machine(threads: int | None = None, reps: int = 3) -> dict:
    """fp32 and bf16 GEMM GFLOP/s (matmul_gflops: the faster) and memory GB/s with `threads` torch threads
    (about a second on 2 cores)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        m, k, n = GEMM_SHAPE
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        torch.mm(a, b, out=out)  # the first call pays for thread-pool start-up
        gemm_s = _median_seconds(lambda: torch.mm(a, b, out=out), reps)
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        out16 = torch.mm(a16, b16)
        bf16_s = _median_seconds(lambda: torch.mm(a16, b16, out=out16), reps)
        src = torch.ones(STREAM_BYTES // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch of dst's pages is page faults, not bandwidth
        src.sum()
        read_s = _median_seconds(src.sum, reps)
        copy_s = _median_seconds(lambda: dst.copy_(src), reps)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    read_gbps = STREAM_BYTES / read_s / 1e9
    copy_gbps = 2 * STREAM_BYTES / copy_s / 1e9  # a copy reads and writes every byte
    # The better of the two: a floor must assume the best bandwidth the machine shows.
    fp32, bf16 = 2 * m * k * n / gemm_s / 1e9, 2 * m * k * n / bf16_s / 1e9
    return {"threads": used, "matmul_gflops": round(max(fp32, bf16), 2), "fp32_gemm_gflops": round(fp32, 2),
            "bf16_gemm_gflops": round(bf16, 2),
            "read_gbps": round(read_gbps, 2), "copy_gbps": round(copy_gbps, 2),
            "memory_gbps": round(max(read_gbps, copy_gbps), 2)}


# ---------------------------------------------------------------- FLOPs and bytes from the model config

def layer_matmul_params(cfg) -> int:
    """Weights of every decoder layer's matmuls: q, k, v, o and the gated MLP's gate, up, down."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return cfg.num_hidden_layers * (attn + 3 * h * cfg.intermediate_size)


def attention_flops(cfg, context: float) -> float:
    """QK^T and PV of one token over `context` positions, every layer and query head."""
    return 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context


def token_flops(cfg, context: float, logits: bool) -> float:
    """One token through the model attending to `context` positions (itself included)."""
    return (2 * layer_matmul_params(cfg) + attention_flops(cfg, context)
            + (2 * cfg.hidden_size * cfg.vocab_size if logits else 0))


def workload_flops(cfg, requests: list[tuple[int, int]]) -> float:
    """(prompt_len, output_len) requests run to completion. The last sampled token never goes through the
    model, so a request feeds prompt_len + output_len - 1 tokens; the one at position p attends to p + 1
    positions; logits are computed output_len times (the prompt's last position, then every decode step)."""
    total = 0.0
    for prompt_len, output_len in requests:
        fed = prompt_len + output_len - 1
        total += (fed * 2 * layer_matmul_params(cfg) + attention_flops(cfg, fed * (fed + 1) / 2)
                  + output_len * 2 * cfg.hidden_size * cfg.vocab_size)
    return total


def dense_weight_bytes(cfg, itemsize: int) -> int:
    """Bytes a dense engine (transformers) streams per decode step: the layer matmuls, the LM head and one
    embedding row. A tied LM head is the embedding matrix, read in full either way."""
    return (layer_matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size + cfg.hidden_size) * itemsize


def pagellm_weight_bytes(model) -> int:
    """Bytes pagellm's few-row step reads: each Linear's packed copy where it has one (that is what the
    native kernels stream), else its float32 weight; plus one embedding row."""
    from pagellm.model.layers.linear import Linear

    total = 0
    for mod in model.modules():
        if not isinstance(mod, Linear):
            continue
        if mod.packed is not None:
            total += mod.packed.nbytes
        elif mod.weight_t.numel():
            total += mod.weight_t.numel() * mod.weight_t.element_size()
        else:  # a tied LM head without its transposed copy reads the embedding matrix
            emb = model.embed_tokens.weight
            total += emb.numel() * emb.element_size()
        if mod.bias is not None:
            total += mod.bias.numel() * mod.bias.element_size()
    emb = model.embed_tokens.weight
    return total + emb.shape[1] * emb.element_size()


# ---------------------------------------------------------------- floors and ratios

def throughput_floor(cfg, requests: list[tuple[int, int]], machine: dict, measured_out_tok_s: float) -> dict:
    """Offline throughput is compute-bound: batches are wide enough that weights are read far less often
    than they are used, so the floor is the workload's FLOPs at GEMM speed."""
    flops = workload_flops(cfg, requests)
    floor_s = flops / (machine["matmul_gflops"] * 1e9)
    floor_tok_s = sum(o for _, o in requests) / floor_s
    return {"workload_flops": flops, "floor_s": round(floor_s, 4),
            "floor_output_tokens_per_s": round(floor_tok_s, 2),
            "measured_over_floor": significant(measured_out_tok_s / floor_tok_s)}


def decode_floor(cfg, weight_bytes: int, kv_bytes_per_token: int, prompt_len: int, output_len: float, batch: int,
                 machine: dict, measured_tok_s: float) -> dict:
    """One decode step of `batch` requests reads the weights once and each request's KV. Decode steps sit
    at positions prompt_len .. prompt_len + output_len - 2, attending to p + 1 positions: on average
    prompt_len + output_len / 2. The binding floor is the lower of the memory and compute ones."""
    context = prompt_len + output_len / 2
    step_bytes = weight_bytes + batch * kv_bytes_per_token * context
    step_flops = batch * token_flops(cfg, context, logits=True)
    memory_tok_s = batch * machine["memory_gbps"] * 1e9 / step_bytes
    compute_tok_s = batch * machine["matmul_gflops"] * 1e9 / step_flops
    floor = min(memory_tok_s, compute_tok_s)
    return {"batch_size": batch, "mean_context": context, "weight_bytes_per_step": weight_bytes,
            "kv_bytes_per_step": round(step_bytes - weight_bytes), "bytes_per_step": round(step_bytes),
            "flops_per_step": round(step_flops), "memory_floor_tok_s": round(memory_tok_s, 2),
            "compute_floor_tok_s": round(compute_tok_s, 2), "floor_tok_s": round(floor, 2),
            "bound": "memory" if memory_tok_s <= compute_tok_s else "compute",
            "measured_over_floor": significant(measured_tok_s / floor)}


# ---------------------------------------------------------------- printing

def machine_line(machine: dict) -> str:
    return (f"roofline: {machine['threads']} threads, GEMM {machine['matmul_gflops']} GFLOP/s (fp32 "
            f"{machine['fp32_gemm_gflops']}, bf16 {machine['bf16_gemm_gflops']}), "
            f"memory {machine['memory_gbps']} GB/s (read {machine['read_gbps']}, copy {machine['copy_gbps']})")


def throughput_line(engine: str, fl: dict) -> str:
    return (f"roofline {engine:<13} {fl['workload_flops'] / 1e9:.2f} GFLOP -> floor {fl['floor_s']} s, "
            f"{fl['floor_output_tokens_per_s']} out tok/s; measured/floor {fl['measured_over_floor']}")


def decode_line(engine: str, fl: dict) -> str:
    return (f"roofline {engine:<13} batch {fl['batch_size']:>3}: {fl['bytes_per_step'] / 2**20:.1f} MiB/step "
            f"({fl['weight_bytes_per_step'] / 2**20:.1f} weights), {fl['flops_per_step'] / 1e6:.1f} MFLOP/step -> "
            f"floor {fl['floor_tok_s']} tok/s ({fl['bound']}-bound; memory {fl['memory_floor_tok_s']}, "
            f"compute {fl['compute_floor_tok_s']}); measured/floor {fl['measured_over_floor']}")
