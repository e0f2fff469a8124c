"""How long xgrammar takes to compile a structured-output spec as it grows: N distinct choices as a choice list, a
JSON-schema enum and a regex alternation, on the bundled SmolLM2's vocabulary, through pagellm's
StructuredOutputManager with MAX_SPEC_CHARS lifted (one compile each, cold). The figures behind MAX_SPEC_CHARS
(structured_output/manager.py; benchmarks/NOTES.md, thirty-second session) come from:

    .venv/bin/python benchmarks/microbench_grammar_compile.py 100 1000 3000 5000 8000 9000 10000 20000
"""

import json
import sys
import time

import pagellm.structured_output.manager as manager_module
from pagellm.model.loader import default_model_path
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.manager import StructuredOutputManager
from pagellm.tokenizer import Tokenizer


def main() -> None:
    manager_module.MAX_SPEC_CHARS = 1 << 40  # measure past the cap
    tok = Tokenizer.from_path(default_model_path())
    manager = StructuredOutputManager(tok, 49152, [2])
    manager.compile(StructuredOutputsParams(choice=["a", "b"]))  # xgrammar loaded, the vocabulary converted
    print("choices | characters | choice s | enum s | regex s")
    for n in (int(a) for a in sys.argv[1:] or ["1000", "5000"]):
        items = [f"o{n}_{j}" for j in range(n)]
        specs = [StructuredOutputsParams(choice=items),
                 StructuredOutputsParams(json={"type": "object", "properties": {"a": {"enum": items}}}),
                 StructuredOutputsParams(regex="(" + "|".join(items) + ")")]
        times = []
        for spec in specs:
            t = time.perf_counter()
            manager.compile(spec)
            times.append(time.perf_counter() - t)
        print(f"{n} | {len(json.dumps(items))} | " + " | ".join(f"{t:.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
