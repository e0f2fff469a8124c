"""`triton_paged`'s forward_qkv: q and k rotated and the KV cache written by one kernel from the qkv projection's
output (rope_write_kv), then attention on q in place, against the unfused path every other backend takes
(AttentionBackend.forward_qkv: RotaryEmbedding, split, write, attend) in TorchSdpaReferenceAttention.

Importing test_triton_attention sets Triton's interpreter up (before triton is first imported) or skips this
module as it skips that one; its `interpreter` fixture turns the interpreter on for these tests too, and its
batches (blocks in random order, NaN in every slot no request owns) are the inputs here.
Tolerances: float32 1e-5 (cache and rotated qkv bit for bit on the CPU: both rotate in float32); 16-bit as
test_triton_attention's against float32 (float16 2e-3, bfloat16 2e-2): the fused kernel rotates in float32
and rounds once, the unfused path rounds each product and the sum in the 16-bit dtype, so a rotated element
may differ by an ulp (2^-8 relative in bfloat16), which moves the scores and outputs by less than that.
"""

from __future__ import annotations

import pytest
import test_triton_attention
import torch
from test_triton_attention import DEVICE, ON_GPU, REFERENCE, TOLERANCE, kvw, make_batch, same_bits

from pagellm.model.attention.triton_paged import TritonPagedAttention
from pagellm.model.layers.rotary import RotaryEmbedding

# the interpreter: about a second a case; a hang fails in time
pytestmark = pytest.mark.timeout(120)
interpreter = test_triton_attention.interpreter  # its autouse fixture, in force here by being found here

HEADS, KV_HEADS, HEAD_DIM, SCALE = 8, 2, 32, 32**-0.5
ROTARY = RotaryEmbedding(HEAD_DIM, 128, 10000.0).to(DEVICE)  # plain torch rotary (forward_native)


def mixed_batch(dtype, cache_dtype=None):
    """Decodes, a whole prompt and a chunk after a cached prefix: qkv [T, (H + 2 KV) * D], positions, cache."""
    new, lens = [1, 7, 1, 20], [33, 7, 2, 40]
    q, k, v, cache, meta = make_batch(new, lens, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype,
                                      cache_dtype=cache_dtype)
    positions = torch.tensor([p for n, s in zip(new, lens, strict=True) for p in range(s - n, s)], device=DEVICE)
    return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), positions, cache, meta


def forward_qkv(backend, qkv, positions, cache, meta, dtype):
    return backend.forward_qkv(qkv, positions, ROTARY, dtype, HEADS, KV_HEADS, HEAD_DIM, cache, meta, SCALE)


@pytest.fixture
def fused_calls(monkeypatch):
    """The rope_write_kv launches (the backend calls it through the module)."""
    calls, rope = [], kvw.rope_write_kv
    monkeypatch.setattr(kvw, "rope_write_kv", lambda *a: calls.append(a[0].shape[0]) or rope(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_forward_qkv_equals_the_unfused_path(dtype, fused_calls):
    qkv, positions, cache, meta = mixed_batch(dtype)
    ref_qkv, ref_cache = qkv.clone(), cache.clone()
    ref = forward_qkv(REFERENCE, ref_qkv, positions, ref_cache, meta, dtype)
    out = forward_qkv(TritonPagedAttention(), qkv, positions, cache, meta, dtype)
    assert fused_calls == [qkv.shape[0]]
    assert out.dtype == dtype and out.shape == (qkv.shape[0], HEADS, HEAD_DIM) and not out.isnan().any()
    if dtype == torch.float32 and not ON_GPU:  # (a GPU may contract x * cos - y * sin into an FMA)
        assert same_bits(qkv, ref_qkv) and same_bits(cache, ref_cache)
    tol = TOLERANCE[dtype]
    # slots no request owns stay NaN in both: nothing was written outside slot_mapping
    torch.testing.assert_close(cache.float().cpu(), ref_cache.float().cpu(), rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(qkv.float().cpu(), ref_qkv.float().cpu(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", ["cast_first", "fp8_cache", "no_rotary_tables"])
def test_what_the_kernel_cannot_do_takes_the_unfused_path(case, fused_calls):
    """A bf16 product's qkv under a float32 model (the rotary casts first), an fp8 cache (written by torch's
    clamp and rounding) and a rotary without plain cos/sin tables: the same result as the reference backend."""
    dtype, cache_dtype, rotary = torch.float32, None, ROTARY
    if case == "fp8_cache":
        cache_dtype = torch.float8_e5m2
    elif case == "no_rotary_tables":
        class Rotary(torch.nn.Module):  # RotaryEmbedding's result, but no cos/sin for the kernel to read
            def __init__(self):
                super().__init__()
                self.inner = ROTARY

            def forward(self, *args):
                return self.inner(*args)

        rotary = Rotary()
    qkv, positions, cache, meta = mixed_batch(dtype, cache_dtype)
    if case == "cast_first":
        qkv = qkv.to(torch.bfloat16)
    ref_cache = cache.clone()
    ref = REFERENCE.forward_qkv(qkv.clone(), positions, rotary, dtype, HEADS, KV_HEADS, HEAD_DIM, ref_cache, meta,
                                SCALE)
    out = TritonPagedAttention(cache.dtype).forward_qkv(qkv, positions, rotary, dtype, HEADS, KV_HEADS, HEAD_DIM,
                                                        cache, meta, SCALE)
    assert not fused_calls
    assert out.dtype == dtype and same_bits(cache, ref_cache)
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5)


def test_engine_generates_the_same_tokens_through_the_fused_path(tmp_path, fused_calls):
    """A whole engine on a tiny random Llama (float32, prefill and decode steps): triton_paged, whose every
    layer takes the fused path, gives the reference backend's greedy tokens."""
    from pagellm import LLM, SamplingParams
    from pagellm.bench.random_model import write_random_llama

    path = write_random_llama(str(tmp_path / "m"), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=128, vocab_size=300, dtype=torch.float32,
                              max_position_embeddings=256, std=0.1)  # peaked logits: no near-ties to flip
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], list(range(100, 119))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for backend in ("torch_sdpa_reference", "triton_paged"):
        llm = LLM(path, kv_cache_memory="4MiB", attention_backend=backend)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton_paged"] == tokens["torch_sdpa_reference"]
    assert len(tokens["triton_paged"][0]) == 4
    assert len(fused_calls) >= 2 * 4 and sum(fused_calls) >= 2 * (7 + 3 + 19)  # 2 layers: every prompt row
