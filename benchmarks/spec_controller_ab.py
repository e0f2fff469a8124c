"""Two speculation controllers against plain decoding at one batch size, in one process, the three engines' runs
alternating: plain, a controller from OLD_ADAPTIVE_PY (e.g. an older pagellm/spec_decode/adaptive.py, from `git
show REV:pagellm/spec_decode/adaptive.py > /tmp/old_adaptive.py`), and this tree's. The grounded task of `pagellm
bench latency`, 200 tokens, n-gram k = 4; each run's decode tok/s, and the median ratios. The forty-second session's
figures in benchmarks/NOTES.md (old = 2d97a7e~1) come from

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/spec_controller_ab.py OLD 4 10   (and 1 5)
"""

import importlib.util
import statistics
import sys

import pagellm.engine.llm_engine as llm_engine
from pagellm import LLM
from pagellm.bench.common import latency_prompts, timed_latency_run


def main() -> None:
    spec = importlib.util.spec_from_file_location("old_adaptive", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    new_cls = llm_engine.SpeculationController
    ngram = dict(speculative_method="ngram", num_speculative_tokens=4)
    engines = {}
    for name, extra, cls in (("plain", {}, new_cls), ("old", ngram, old.SpeculationController),
                             ("new", ngram, new_cls)):
        llm_engine.SpeculationController = cls  # what the engine builds its controller from
        llm = LLM(dtype="auto", **extra)
        prompts = latency_prompts(llm.engine.tokenizer, llm.engine.model_config.vocab_size, "grounded", 128, batch)
        timed_latency_run(llm, prompts[:1], 8, False)  # the bench's warm-up
        engines[name] = (llm, prompts)
    llm_engine.SpeculationController = new_cls
    res = {k: [] for k in engines}
    ids = {}
    for i in range(iters):
        for k, (llm, prompts) in engines.items():
            r = timed_latency_run(llm, prompts, 200, False)
            res[k].append(r["decode_tok_s"])
            ids.setdefault(k, r["token_ids"])
        print(f"run {i}: " + "  ".join(f"{k} {v[-1]:.1f}" for k, v in res.items()) +
              f"  old/plain {res['old'][-1] / res['plain'][-1]:.3f} new/plain {res['new'][-1] / res['plain'][-1]:.3f}",
              flush=True)
    plain = statistics.median(res["plain"])
    print(f"batch {batch}: median ratio old {statistics.median(res['old']) / plain:.3f}, new "
          f"{statistics.median(res['new']) / plain:.3f}; identical output {ids['old'] == ids['plain'] == ids['new']}")


if __name__ == "__main__":
    main()
