"""`pagellm quantize`: a float model (HF directory, or a GGUF dequantized) -> a GPTQ or AWQ checkpoint.

    pagellm quantize --method gptq --bits 4 --group-size 128 --out /tmp/smollm2-gptq   # the bundled SmolLM2
    pagellm quantize --model DIR --method awq --keep lm_head,layers.0. --out DIR2

Every option is checked before any weight is read; a bad one is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from pagellm import cli_types
from pagellm.config import QUANT_GROUP_SIZES
from pagellm.model_config import ModelConfig

logger = logging.getLogger("pagellm.quantize")
METHODS = ("rtn", "gptq", "awq")
FORMATS = ("gptq", "awq", "compressed-tensors")
# A few KB of original English prose written for pagellm (public domain / CC0): enough for 135M-class
# models at 4 bits; --calibration takes a larger or domain-specific text.
DEFAULT_CALIBRATION = os.path.join(os.path.dirname(__file__), "calibration.txt")


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="write a GPTQ/AWQ 4/8-bit checkpoint of a float model",
                       description=__doc__.splitlines()[0])
    q.add_argument("--model", default=None, help="an HF float directory or a .gguf (default: the bundled SmolLM2)")
    q.add_argument("--tokenizer", default=None, help="tokenizer for the calibration text (default: the model's)")
    q.add_argument("--method", default="gptq", help="rtn (round to nearest), gptq or awq (default gptq)")
    q.add_argument("--bits", type=int, default=4, help="4 or 8 (awq: 4)")
    q.add_argument("--group-size", type=int, default=None,
                   help="input columns per scale: 32, 64 or 128 (default: 128, or the largest that divides the "
                        "model's inputs: 64 for SmolLM2-135M's 576)")
    q.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True,
                   help="rtn/gptq: symmetric codes (zero point 2^(bits-1), what vLLM's Marlin kernels take; "
                        "default); --no-sym: a zero point per group (awq always has one)")
    q.add_argument("--format", default=None, choices=FORMATS,
                   help="checkpoint layout (default: gptq for rtn/gptq, awq for awq); compressed-tensors: "
                        "pack-quantized, which transformers reads with only the compressed-tensors package")
    q.add_argument("--desc-act", action="store_true", help="gptq: act-order (columns by decreasing activation)")
    q.add_argument("--calibration", default=None,
                   help="UTF-8 text file for gptq/awq activations (default: a few KB of English shipped with pagellm)")
    q.add_argument("--num-samples", type=int, default=32, help="calibration windows (default 32)")
    q.add_argument("--seq-len", type=int, default=128, help="tokens per calibration window (default 128)")
    q.add_argument("--keep", default="", help="comma list of module-name substrings kept in float, e.g. layers.0.")
    q.add_argument("--num-threads", type=cli_types.thread_count, default=None,
                   help="torch CPU threads (default: torch's; on a loaded machine 1 can be several times faster)")
    q.add_argument("--out", required=True, help="output directory (new or empty)")
    q.set_defaults(func=run_quantize)


def check_options(ns: argparse.Namespace, cfg: ModelConfig) -> None:
    """Every refusal, before the weights are read (ValueError: one line, exit 2)."""
    if ns.method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {ns.method!r}")
    if ns.bits not in (4, 8) or (ns.method == "awq" and ns.bits != 4):
        raise ValueError(f"--bits must be 4 or 8 (awq: 4), got {ns.bits}")
    ns.format = ns.format or ("awq" if ns.method == "awq" else "gptq")
    if ns.format == "awq" and ns.method != "awq" or ns.format == "gptq" and ns.method == "awq":
        raise ValueError(f"--format {ns.format} holds {ns.format} output only; --method {ns.method} writes "
                         f"{'awq' if ns.method == 'awq' else 'gptq'} or compressed-tensors")
    if ns.desc_act and ns.method != "gptq":
        raise ValueError(f"--desc-act is for --method gptq, not {ns.method}")
    if ns.format == "compressed-tensors" and (ns.desc_act or not ns.sym or ns.method == "awq"):
        raise ValueError("--format compressed-tensors is written for symmetric rtn/gptq without --desc-act only")
    inputs = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_attention_heads * head_dim": cfg.num_attention_heads * cfg.head_dim}
    if ns.group_size is None:  # the default: the largest that divides every input size
        ns.group_size = next((g for g in sorted(QUANT_GROUP_SIZES, reverse=True)
                              if all(k % g == 0 for k in inputs.values())), max(QUANT_GROUP_SIZES))
    if ns.group_size not in QUANT_GROUP_SIZES:
        raise ValueError(f"--group-size must be 32, 64 or 128, got {ns.group_size}")
    for what, k in inputs.items():
        if k % ns.group_size:
            raise ValueError(f"--group-size {ns.group_size} does not divide the model's {what} ({k})")
    outputs = {"num_key_value_heads * head_dim": cfg.num_key_value_heads * cfg.head_dim, **inputs}
    for what, n in outputs.items():
        if n % (32 // ns.bits):
            raise ValueError(f"the model's {what} ({n}) does not pack into int32 words of {ns.bits}-bit codes")
    if ns.method != "rtn":
        if ns.calibration is not None and not os.path.isfile(ns.calibration):
            raise ValueError(f"--calibration {ns.calibration}: no such file")
        if ns.num_samples < 1 or ns.seq_len < 2 or ns.seq_len > cfg.max_position_embeddings:
            raise ValueError(f"--num-samples must be >= 1 and --seq-len in [2, {cfg.max_position_embeddings}], "
                             f"got {ns.num_samples} and {ns.seq_len}")
        if cfg.sliding_window and ns.seq_len > cfg.sliding_window:  # the calibration forward attends to all
            raise ValueError(f"--seq-len {ns.seq_len} exceeds the model's sliding window ({cfg.sliding_window})")
    if os.path.exists(ns.out) and (not os.path.isdir(ns.out) or os.listdir(ns.out)):
        raise ValueError(f"--out {ns.out} exists and is not an empty directory")
    check_writable_dir(ns.out)


def check_keep(keep: list[str], cfg: ModelConfig) -> None:
    """Every --keep substring must name some decoder matrix (a typo had quantized everything, silently), and
    one matrix at least must be left to quantize. lm_head is never quantized: naming it is allowed."""
    from pagellm.quant.calibration import ATTN, MLP, module_name

    names = [module_name(i, p) for i in range(cfg.num_hidden_layers) for p in ATTN + MLP]
    unmatched = [k for k in keep if k != "lm_head" and not any(k in n for n in names)]
    if unmatched:
        raise ValueError(f"--keep {','.join(unmatched)}: matches no decoder matrix (their names are like "
                         f"{names[0]})")
    if keep and all(any(k in n for k in keep) for n in names):
        raise ValueError("--keep keeps every decoder matrix in float: nothing would be quantized")


def check_writable_dir(path: str) -> None:
    """That the output directory can be made and written now, not after minutes of calibration."""
    if not path:
        raise ValueError("--out is empty: name an output directory")
    try:  # made now, as the writer would: an unwritable parent or /proc fails here
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: {e.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: not writable")


def run_quantize(ns: argparse.Namespace) -> int:
    from pagellm.model.loader import is_gguf_path, load_config, resolve_model_path

    path = resolve_model_path(ns.model)
    if not is_gguf_path(path):
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
        if (hf.get("quantization_config") or {}).get("quant_method"):
            raise ValueError(f"{path} is quantized already ({hf['quantization_config']['quant_method']}); "
                             "quantize its float original")
    cfg = load_config(path)
    made_out = bool(ns.out) and not os.path.exists(ns.out)
    ns.keep = [k.strip() for k in ns.keep.split(",") if k.strip()]
    check_keep(ns.keep, cfg)  # before --out is made: a typo leaves no empty directory
    check_options(ns, cfg)  # makes --out
    t0 = time.perf_counter()
    try:
        out = quantize(path, cfg, ns)
    except BaseException:
        if made_out and os.path.isdir(ns.out) and not os.listdir(ns.out):
            os.rmdir(ns.out)  # a failure (a bad tokenizer or calibration file) leaves no empty --out behind
        raise
    logger.info("wrote %s in %.1fs", out, time.perf_counter() - t0)
    print(out)
    return 0


def quantize(path: str, cfg: ModelConfig, ns: argparse.Namespace) -> str:
    import torch

    from pagellm.model.loader import is_gguf_path, iter_weights
    from pagellm.quant.calibration import calibration_tokens
    from pagellm.quant.checkpoint_writer import (
        checkpoint_tensors,
        hf_config_dict,
        quantization_config,
        write_checkpoint,
    )
    from pagellm.quant.quantize_model import QuantizeSettings, quantize_state
    from pagellm.tokenizer import Tokenizer

    settings = QuantizeSettings(ns.method, ns.bits, ns.group_size, ns.sym if ns.method != "awq" else False,
                                ns.desc_act and ns.method == "gptq", ns.keep)
    tokenizer = None
    if ns.method != "rtn" or is_gguf_path(path):
        tokenizer = Tokenizer.from_path(ns.tokenizer or path)
    tokens = None
    if ns.method != "rtn":
        tokens = calibration_tokens(tokenizer, ns.calibration or DEFAULT_CALIBRATION, ns.num_samples, ns.seq_len,
                                    cfg.vocab_size)
    torch.set_grad_enabled(False)
    if ns.num_threads:
        torch.set_num_threads(ns.num_threads)
    state = {name: t.float() for name, t in iter_weights(path, cfg, torch.float32)}
    logger.info("%s %d-bit, group %d: %d layers%s", ns.method, ns.bits, ns.group_size, cfg.num_hidden_layers,
                "" if tokens is None else f", calibration {tuple(tokens.shape)} tokens")
    codes = quantize_state(state, cfg, settings, tokens)
    if is_gguf_path(path):
        config = hf_config_dict(cfg)
    else:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    config["torch_dtype"] = "float16"
    config["quantization_config"] = quantization_config(ns.method, ns.bits, ns.group_size, settings.sym,
                                                        settings.desc_act, ns.keep, ns.format)
    write_checkpoint(ns.out, checkpoint_tensors(state, codes, ns.format), config, path, tokenizer)
    return ns.out
