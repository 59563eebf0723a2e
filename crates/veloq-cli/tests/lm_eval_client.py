"""lm-evaluation-harness's `local-completions` against a running `veloq serve` (started by
tests/serve.rs): a loglikelihood task (multiple choice) over the server's `echo` + `logprobs`,
checked against an independent reference — the same GGUF model run by transformers.

    python3 lm_eval_client.py http://127.0.0.1:PORT/v1 MODEL_ID

Exits non-zero with a message on the first check that fails.
"""

import json
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lm_eval  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

base, model = sys.argv[1], sys.argv[2]
cache = pathlib.Path(os.environ.get("VELOQ_CACHE", pathlib.Path.home() / ".cache" / "veloq"))
gguf = "smollm2-135m-instruct.q4_1.gguf"


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")
    print(f"ok: {what}")


# lm-eval joins a question and a choice with a space (its default target delimiter).
QUESTIONS = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid"], 0),
    ("Two plus two equals", ["seven", "four", "ten"], 1),
    ("The sun rises in the", ["west", "north", "east"], 2),
    ("Water freezes at zero degrees", ["Celsius", "Kelvin", "Rankine"], 0),
]

work = pathlib.Path(tempfile.mkdtemp(prefix="veloq-lm-eval-"))
# lm-eval tokenizes requests itself: the model's tokenizer, as transformers reads it from the GGUF.
tok = transformers.AutoTokenizer.from_pretrained(cache, gguf_file=gguf)
tok.save_pretrained(work / "tokenizer")
with open(work / "questions.jsonl", "w") as f:
    for q, choices, answer in QUESTIONS:
        f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
(work / "tasks").mkdir()
(work / "tasks" / "veloq_facts.yaml").write_text(f"""task: veloq_facts
dataset_path: json
dataset_kwargs:
  data_files: {work / 'questions.jsonl'}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")

results = lm_eval.simple_evaluate(
    model="local-completions",
    model_args=f"model={model},base_url={base}/completions,tokenizer_backend=huggingface,"
    f"tokenizer={work / 'tokenizer'},tokenized_requests=True,num_concurrent=1,max_retries=1",
    tasks=["veloq_facts"],
    task_manager=TaskManager(include_path=str(work / "tasks")),
    log_samples=True,
)
samples = results["samples"]["veloq_facts"]
check(len(samples) == len(QUESTIONS), f"{len(samples)} documents scored")

# The reference: each continuation's log-likelihood after its context under the same weights,
# run by transformers (float32, its own attention) on the token ids lm-eval sent.
hf = transformers.AutoModelForCausalLM.from_pretrained(cache, gguf_file=gguf).eval()
worst, ours, reference = 0.0, [], []
# Both run the same Q4_1 weights, but not the same arithmetic: veloq multiplies the quantized
# blocks with its own kernels and keeps keys and values in f16, transformers dequantizes to float32
# and attends in float32. Per token the log-probabilities differ by that rounding (up to 0.05 nats
# measured here, on unlikely tokens), so a continuation's sum by at most 0.1 nats a token — far
# below the margins between these choices (the answers chosen are compared too).
PER_TOKEN = 0.1
for s in sorted(samples, key=lambda s: s["doc_id"]):
    q, choices, answer = QUESTIONS[s["doc_id"]]
    got = [float(r[0][0]) for r in s["resps"]]
    want, lengths = [], []
    # The (context, continuation) pairs lm-eval scored, split as it splits them: the context's
    # trailing space moves to the continuation, and the continuation's tokens are the whole's
    # after the context's.
    for context, continuation in s["arguments"]:
        n = len(context) - len(context.rstrip(" "))
        context, continuation = context[: len(context) - n], context[len(context) - n :] + continuation
        ctx = tok(context, add_special_tokens=False).input_ids
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        ids = torch.tensor([ctx + whole[len(ctx):]])
        with torch.no_grad():
            lp = torch.log_softmax(hf(ids).logits[0].float(), -1)
        want.append(sum(float(lp[i - 1, ids[0, i]]) for i in range(len(ctx), ids.shape[1])))
        lengths.append(ids.shape[1] - len(ctx))
        print(f"  {continuation!r}: veloq {got[len(want) - 1]:.4f}, transformers {want[-1]:.4f} ({lengths[-1]} tokens)")
    worst = max(worst, max(abs(g - w) / n for g, w, n in zip(got, want, lengths)))
    ours.append(max(range(len(got)), key=got.__getitem__) == answer)
    reference.append(max(range(len(want)), key=want.__getitem__) == answer)
    check(all(g < 0 for g in got), f"doc {s['doc_id']}: log-likelihoods {got}")
print(f"largest difference from transformers: {worst:.4f} nats per continuation token")
check(worst < PER_TOKEN, f"loglikelihoods match the reference within {PER_TOKEN} nats a token (largest {worst:.4f})")
acc = results["results"]["veloq_facts"]["acc,none"]
check(abs(acc - sum(ours) / len(ours)) < 1e-9, f"acc {acc} is the share of documents whose answer scores highest")
check(ours == reference, f"the same answers chosen as by the reference: {ours} vs {reference}")
print("all passed")
