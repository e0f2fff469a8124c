"""lm-evaluation-harness against `pagellm serve`: its `local-completions` model runs a small local
multiple-choice task (loglikelihood: echo + logprobs + max_tokens 1) and a generate-until task, and gets the
same per-request numbers and scores as the offline LLM API computes for the same token ids."""

import json

import pytest
from test_server import Server

from pagellm import LLM, SamplingParams

lm_eval = pytest.importorskip("lm_eval")  # an optional test dependency

# SmolLM2-135M on 2 CPU cores: ~20 short scoring requests and 4 generations, plus two model loads
pytestmark = pytest.mark.timeout(300)

SERVED = "smol"
MC = [
    {"question": "What is the capital of France?", "choices": ["Paris", "London", "Madrid"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"], "answer": 1},
    {"question": "What color is the sky on a clear day?", "choices": ["green", "red", "blue"], "answer": 2},
    {"question": "Which animal says moo?", "choices": ["cow", "cat", "dog"], "answer": 0},
    {"question": "What is 2 + 2?", "choices": ["three", "four", "five"], "answer": 1},
    {"question": "Which planet do we live on?", "choices": ["Mars", "Venus", "Earth"], "answer": 2},
]
# Two targets are what SmolLM2 answers greedily, two are not: exact match is 0.5 only if lm-eval got our text.
GEN = [{"prompt": "Q: What is the capital of France?\nA:", "target": " Paris"},
       {"prompt": "Q: What is 2 + 2?\nA:", "target": " 2 + 2 = 4"},
       {"prompt": "The opposite of hot is", "target": " cold."},
       {"prompt": "One, two, three,", "target": " four"}]

TASKS = """\
task: pagellm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
---
task: pagellm_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC))
    (d / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN))
    mc, gen = TASKS.format(dir=d).split("---\n")
    (d / "pagellm_mc.yaml").write_text(mc)
    (d / "pagellm_gen.yaml").write_text(gen)
    return d


@pytest.fixture(scope="module")
def tokenizer_dir(hf_gguf_tokenizer, tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizer")  # lm-eval counts context tokens with it; no download
    hf_gguf_tokenizer.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def server(smollm_gguf_path, tmp_path_factory):
    s = Server(["--model", smollm_gguf_path, "--served-model-name", SERVED, "--kv-cache-memory", "64MiB"],
               tmp_path_factory.mktemp("srv") / "server.log")
    yield s
    s.stop()


def test_lm_eval_local_completions_matches_offline_llm(server, task_dir, tokenizer_dir, smollm_gguf_path,
                                                       monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(task_dir / "hf_cache"))
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    lm = get_model("local-completions")(
        model=SERVED, base_url=server.url + "/v1/completions", tokenizer_backend="huggingface",
        tokenizer=tokenizer_dir, tokenized_requests=True, num_concurrent=2, max_retries=1, batch_size=1,
        max_length=2048, timeout=120)
    res = lm_eval.simple_evaluate(model=lm, tasks=["pagellm_mc", "pagellm_gen"],
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                  num_fewshot=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)

    llm = LLM(smollm_gguf_path, kv_cache_memory="64MiB")
    # multiple choice: every (context, choice) loglikelihood, recomputed offline on the same token ids
    samples = sorted(res["samples"]["pagellm_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(MC)
    correct = 0
    for s in samples:
        pairs = [lm._encode_pair(*a) for a in s["arguments"]]
        outs = llm.generate([c + x for c, x in pairs],
                            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        offline = [sum(o.prompt_logprobs[j][o.prompt_token_ids[j]].logprob for j in range(len(c), len(c) + len(x)))
                   for o, (c, x) in zip(outs, pairs, strict=True)]
        served = [r[0][0] for r in s["resps"]]
        assert served == pytest.approx(offline, abs=1e-3), s["doc"]
        correct += max(range(len(offline)), key=offline.__getitem__) == s["doc"]["answer"]
    assert res["results"]["pagellm_mc"]["acc,none"] == pytest.approx(correct / len(MC))
    assert correct >= 3  # greedy float32, so deterministic: SmolLM2 beats chance (2 of 6) on these

    # generate until: greedy text with the same stop, then lm-eval's exact match
    samples = sorted(res["samples"]["pagellm_gen"], key=lambda s: s["doc_id"])
    outs = llm.generate([lm.tok_encode(s["arguments"][0][0]) for s in samples],
                        SamplingParams(temperature=0.0, max_tokens=8, stop=["\n"]), use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert [s["resps"][0][0] for s in samples] == texts
    expected = sum(t == g["target"] for t, g in zip(texts, GEN, strict=True)) / len(GEN)
    assert res["results"]["pagellm_gen"]["exact_match,none"] == pytest.approx(expected) == 0.5
