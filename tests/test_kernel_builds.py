"""The native kernels built for other ISAs than the host's, and the engine without a compiler.

Each build runs in a subprocess (the library is loaded once per process): a build forced to plain
x86-64 (PAGELLM_CPU_ARCH=x86-64: the portable C++ paths, no AVX, what a machine without AVX2 gets)
and the host's, each against a fast subset of tests/test_kernels.py that compares the kernels with
the plain-torch reference.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagellm.kernels import build

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds per subprocess
# The op-by-op comparisons with torch and the tiny-model engine comparisons: ~5 s per build here
# (the SmolLM2 end-to-end tests of test_kernels.py take a minute and need no second ISA to be useful).
KERNEL_SUBSET = ("packed_linear_matches or int8_activation_rows or add_rmsnorm or paged_attention or blas_matmul "
                 "or packed_weight_rows or native_paths_match or draw")  # draw: tests/test_draw.py's kernels
PORTABLE_SUBSET = KERNEL_SUBSET  # test_packed_linear_matches_float32_weights bounds by float32 summation error

needs_compiler = pytest.mark.skipif(
    os.environ.get("PAGELLM_CPU_KERNELS", "1") == "0" or build._compiler() is None,
    reason="native CPU kernels switched off (PAGELLM_CPU_KERNELS=0) or no C++ compiler")


def _env(**overrides: str) -> dict[str, str]:
    # the host build: no -march override, no kernel switch, no PAGELLM_CPU_ISA cap (a capped suite run keeps these
    # tests about the machine's own build)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAGELLM_CPU_ARCH", "PAGELLM_CPU_KERNELS", "PAGELLM_CPU_ISA")}
    env.update(overrides)
    return env


def _python(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


INFO = """
import json
from pagellm.kernels import build
info, lib = build.build_info(), build.cpu_kernels()
if lib is not None:
    info.update(simd=lib.pagellm_has_simd(), f16_kv=lib.pagellm_has_f16_kv())
print(json.dumps(info))
"""


@pytest.fixture(scope="module")
def x86_64_env(tmp_path_factory) -> dict[str, str]:
    """A forced plain x86-64 build in a fresh cache (shared by this module's tests: built once)."""
    return _env(PAGELLM_CPU_ARCH="x86-64", PAGELLM_CACHE_DIR=str(tmp_path_factory.mktemp("x86-64-cache")))


def _build_info(env: dict[str, str]) -> dict:
    return json.loads(_python(INFO, env).stdout.strip().splitlines()[-1])


def _host_has(flag: str) -> bool:
    return flag in build.cpu_flags()


@needs_compiler
@pytest.mark.parametrize("target", ["x86-64", "haswell", "host"])
def test_kernel_tests_pass_on_each_build(target, x86_64_env, tmp_path):
    """x86-64: the portable build; haswell: AVX2 + FMA + F16C and no AVX-512, what an AVX2-only machine
    builds (run here whatever the host has beyond it); host: -march=native."""
    if target == "haswell" and not _host_has("avx2"):
        pytest.skip("the host cannot run AVX2 code")
    env = {"x86-64": x86_64_env, "host": _env(),
           "haswell": _env(PAGELLM_CPU_ARCH="haswell", PAGELLM_CACHE_DIR=str(tmp_path))}[target]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "tests/test_kernels.py", "tests/test_draw.py", "-p",
           "no:cacheprovider",
           "-k", PORTABLE_SUBSET if target == "x86-64" else KERNEL_SUBSET]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    summary = next((ln for ln in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed|skipped)", ln)), "")
    assert proc.returncode == 0, out[-5000:]
    passed = re.search(r"(\d+) passed", summary)
    # the module is skipped as a whole where the library did not build: that must not count as a success
    assert passed and int(passed.group(1)) >= 5, f"too few kernel tests ran: {summary!r}"
    if target == "x86-64":  # the subprocess built its own library, in the fresh cache
        assert len(list(Path(x86_64_env["PAGELLM_CACHE_DIR"]).glob("kernels/*.so"))) == 1


@needs_compiler
def test_build_info_of_host_and_forced_x86_64_builds(x86_64_env):
    portable, host = _build_info(x86_64_env), _build_info(_env())
    assert portable["march"] == "x86-64" and host["march"] == "native"
    assert "avx2" not in portable["isa"] and portable["paths"] == ["portable"]
    assert (portable["simd"], portable["f16_kv"]) == (0, 0)
    assert set(host["isa"]) >= set(portable["isa"])
    assert Path(portable["library"]).parent == Path(x86_64_env["PAGELLM_CACHE_DIR"]) / "kernels"
    assert Path(portable["library"]).name != Path(host["library"]).name  # another -march, another key
    # the feature bits agree with the kernels' own probes
    assert ("avx2-fma" in host["paths"]) == bool(host["simd"])
    assert ("f16c-kv" in host["paths"]) == bool(host["f16_kv"])
    assert ("avx2" in host["isa"] and "fma" in host["isa"]) == ("avx2-fma" in host["paths"])


def test_no_kernels_when_cxx_is_not_a_compiler():
    """$CXX is honoured strictly: not executable -> a warning and no kernels (not another compiler)."""
    proc = _python(INFO, _env(CXX="/nonexistent/g++"))
    assert proc.stdout.strip().splitlines()[-1] == "null"
    assert "CXX=/nonexistent/g++ is not an executable compiler" in proc.stderr


ENGINE = """
import json, sys
from pagellm import LLM, SamplingParams
from pagellm.kernels import cpu_kernels
llm = LLM(sys.argv[1], tokenizer=sys.argv[2], kv_cache_memory="8MiB")
outs = llm.generate([[5, 9, 33, 7, 100], [60, 61]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps({"kernels": cpu_kernels() is not None, "ids": [o.outputs[0].token_ids for o in outs]}))
"""


def test_engine_runs_without_a_compiler(tiny_gguf_model, smollm_gguf_path):
    """No compiler: the engine runs on the plain-torch path and gives what it gives with the kernels off."""
    path = tiny_gguf_model("llama", qtype="Q8_0")

    def run(**env: str) -> dict:
        return json.loads(_python(ENGINE, _env(**env), path, smollm_gguf_path).stdout.strip().splitlines()[-1])

    without_compiler, switched_off = run(CXX="/nonexistent/g++"), run(PAGELLM_CPU_KERNELS="0")
    assert not without_compiler["kernels"]
    assert [len(ids) for ids in without_compiler["ids"]] == [8, 8]
    assert without_compiler["ids"] == switched_off["ids"]


CAPPED = """
import json, os, sys, torch
from pagellm import LLM, SamplingParams
from pagellm.platforms import get_platform
p = get_platform("cpu")
choices = p.op_choices(torch.float32, auto=True)
llm = LLM(sys.argv[1], tokenizer=sys.argv[2], kv_cache_memory="8MiB", dtype="auto")
out = llm.generate([[5, 9, 33, 7, 100]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
print(json.dumps({"isa": p.isa, "describe": p.describe(), "bf16_gemm": choices.bf16_gemm,
                  "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA"), "aten": torch.backends.cpu.get_cpu_capability(),
                  "tokens": len(out[0].outputs[0].token_ids)}))
"""


@needs_compiler
def test_isa_cap_makes_this_cpu_an_avx2_one(tiny_gguf_model, smollm_gguf_path, tmp_path):
    """PAGELLM_CPU_ISA=avx2: the platform sees AVX2 + FMA + F16C only, builds the kernels for haswell, decides as
    on an AVX2-only CPU (float32 under auto: no bf16 GEMMs, prompt rows of q4_1 products on one-plane int8) and caps
    torch's oneDNN and ATen kernels to match."""
    if not _host_has("avx2"):
        pytest.skip("the host cannot run AVX2 code")
    env = _env(PAGELLM_CPU_ISA="avx2", PAGELLM_CACHE_DIR=str(tmp_path))
    for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"):
        env.pop(name, None)
    path = tiny_gguf_model("llama", qtype="Q8_0")
    got = json.loads(_python(CAPPED, env, path, smollm_gguf_path).stdout.strip().splitlines()[-1])
    assert set(got["isa"]) <= {"avx2", "fma", "f16c"} and "avx2" in got["isa"]
    assert got["describe"]["isa"].endswith("(capped by PAGELLM_CPU_ISA=avx2)")
    assert got["describe"]["kernels"].startswith("built for -march=haswell")
    assert not got["bf16_gemm"] and got["describe"]["dtype"] == (
        "auto -> float32, one-plane int8 for prompt rows in q4_1 products (vpmaddubsw)")
    assert (got["onednn"], got["aten"]) == ("AVX2", "AVX2")
    assert got["tokens"] == 8
