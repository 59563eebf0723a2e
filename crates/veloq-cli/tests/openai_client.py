"""The official `openai` client against a running `veloq serve` (started by tests/serve.rs).

    python3 openai_client.py http://127.0.0.1:PORT/v1 MODEL_ID

Exits non-zero with a message on the first check that fails.
"""

import json
import sys

import openai
import pydantic

base, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")
    print(f"ok: {what}")


# The model list names the served model.
ids = [m.id for m in client.models.list().data]
check(ids == [model], f"models.list() = {ids}")
check(client.models.retrieve(model).id == model, "models.retrieve")

# Chat, whole: text, finish reason and usage counts.
r = client.chat.completions.create(model=model, messages=question, max_tokens=12, temperature=0)
text = r.choices[0].message.content
check("Paris" in text, f"chat answer {text!r}")
check(r.choices[0].message.role == "assistant", "assistant role")
check(r.choices[0].finish_reason in ("stop", "length"), f"finish_reason {r.choices[0].finish_reason}")
u = r.usage
check(u.prompt_tokens > 5 and 0 < u.completion_tokens <= 12, f"usage {u}")
check(u.total_tokens == u.prompt_tokens + u.completion_tokens, "total_tokens adds up")

# Chat, streamed: the deltas concatenate to the same greedy text, the last chunk has the reason,
# and a usage chunk when asked for.
chunks = list(
    client.chat.completions.create(
        model=model, messages=question, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}
    )
)
deltas = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
check(deltas == text, f"streamed {deltas!r} == whole {text!r}")
check(chunks[0].choices[0].delta.role == "assistant", "first chunk carries the role")
reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
check(reasons == [r.choices[0].finish_reason], f"one finish reason {reasons}")
check(chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == u.completion_tokens, "usage chunk")

# Text completions, whole and streamed; max_tokens bounds the completion.
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
check(c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 5, f"completion {c.choices[0].text!r}")
streamed = "".join(x.choices[0].text for x in client.completions.create(
    model=model, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True) if x.choices)
check(streamed == c.choices[0].text, f"streamed completion {streamed!r}")

# ignore_eos (llama.cpp's and vLLM's extension) runs past the end of the answer to max_tokens.
short = [{"role": "user", "content": "Say OK."}]
ended = client.chat.completions.create(model=model, messages=short, max_tokens=40, temperature=0)
forced = client.chat.completions.create(model=model, messages=short, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
check(ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 40, f"ends by itself: {ended.usage}")
check(forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 40, f"ignore_eos: {forced.usage}")

# Sampling: the same seed repeats, stop sequences end the text before them.
kw = dict(model=model, prompt="Once upon a time", max_tokens=24, temperature=0.9, top_p=0.95)
a, b = (client.completions.create(seed=11, **kw).choices[0].text for _ in range(2))
check(a == b, "same seed, same text")
words = a.split()
if len(words) > 3:
    stop = " " + words[3]
    s = client.completions.create(seed=11, stop=[stop], **kw).choices[0]
    check(s.text == a[: a.index(stop)] and s.finish_reason == "stop", f"stop {stop!r}: {s.text!r}")

# n choices: each its own sequence and seed (the request's plus its index: the seeds themselves are
# checked in the server's unit tests; a sampled text need not repeat exactly between a batch of
# three and a request alone, whose logits round differently). The prompt is counted once and the
# completions added up; streamed chunks carry their choice's index.
kw = dict(model=model, messages=question, max_tokens=8, temperature=1.0, seed=5, n=3, extra_body={"ignore_eos": True})
many = client.chat.completions.create(**kw)
check([c.index for c in many.choices] == [0, 1, 2], f"n=3: indexes {[c.index for c in many.choices]}")
check(all(c.message.content and c.finish_reason == "length" for c in many.choices), "n=3: three texts")
check(many.usage.prompt_tokens == u.prompt_tokens, "n=3: the prompt counted once")
check(many.usage.completion_tokens == 24, f"n=3: completions add up ({many.usage.completion_tokens})")
texts, ends = ["", "", ""], []
for c in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
    for ch in c.choices:
        texts[ch.index] += ch.delta.content or ""
        ends += [ch.index] if ch.finish_reason else []
    if not c.choices:
        check(c.usage.completion_tokens == 24 and c.usage.prompt_tokens == u.prompt_tokens, "n=3 streamed usage")
check(all(texts) and sorted(ends) == [0, 1, 2], f"n=3 streamed: {texts}, ends {ends}")

# Structured output: the token mask makes the text parse and match the schema, whole and streamed,
# greedy and sampled; the client's own pydantic parsing takes it.
schema = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
          "properties": {"city": {"type": "string", "maxLength": 40},
                         "population": {"type": "integer", "minimum": 0, "maximum": 100000000}}}
fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
ask = [{"role": "user", "content": "Name the capital of France and its population, as JSON."}]
for temperature in (0, 1.0):
    r = client.chat.completions.create(model=model, messages=ask, max_tokens=120, temperature=temperature, seed=3,
                                       response_format=fmt)
    v = json.loads(r.choices[0].message.content)
    check(set(v) == {"city", "population"} and isinstance(v["city"], str) and isinstance(v["population"], int)
          and r.choices[0].finish_reason == "stop", f"json_schema at temperature {temperature}: {v}")
streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
    model=model, messages=ask, max_tokens=120, temperature=0, response_format=fmt, stream=True) if c.choices)
check(json.loads(streamed) == json.loads(client.chat.completions.create(
    model=model, messages=ask, max_tokens=120, temperature=0, response_format=fmt).choices[0].message.content),
    f"json_schema streamed: {streamed}")
obj = client.chat.completions.create(model=model, messages=ask, max_tokens=200, temperature=0,
                                     response_format={"type": "json_object"})
check(isinstance(json.loads(obj.choices[0].message.content), dict), f"json_object: {obj.choices[0].message.content}")


class City(pydantic.BaseModel):
    city: str
    population: int


parsed = client.chat.completions.parse(model=model, messages=ask, max_tokens=120, temperature=0, response_format=City)
check(isinstance(parsed.choices[0].message.parsed, City), f"parse(): {parsed.choices[0].message.parsed!r}")

# Tools: a forced call (required, or one function by name) always parses and matches the
# function's parameters, whole and streamed; a tool loop's second step (the call and its result
# sent back) gets an answer; "auto" returns either text or well-formed calls.
weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 40}}}}}
clock = {"type": "function", "function": {"name": "get_time", "description": "The time now",
         "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
    r = client.chat.completions.create(model=model, messages=ask, max_tokens=60, temperature=0.7, seed=2,
                                       tools=[weather, clock], tool_choice=choice)
    m, call = r.choices[0].message, r.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    check(r.choices[0].finish_reason == "tool_calls" and m.content is None and call.type == "function",
          f"tool_choice {choice}: {call}")
    if call.function.name == "get_weather":
        check(set(args) == {"city"} and isinstance(args["city"], str), f"weather arguments {args}")
    else:
        check(choice == "required" and call.function.name == "get_time" and args == {}, f"clock call {call}")
named = {"type": "function", "function": {"name": "get_weather"}}
calls = {}
for c in client.chat.completions.create(model=model, messages=ask, max_tokens=60, temperature=0, tools=[weather],
                                        tool_choice=named, stream=True):
    for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
        calls.setdefault(tc.index, {"name": "", "arguments": ""})
        calls[tc.index]["name"] += tc.function.name or ""
        calls[tc.index]["arguments"] += tc.function.arguments or ""
    if c.choices and c.choices[0].finish_reason:
        check(c.choices[0].finish_reason == "tool_calls", "streamed finish_reason tool_calls")
check(calls[0]["name"] == "get_weather" and "city" in json.loads(calls[0]["arguments"]), f"streamed call {calls}")
whole = client.chat.completions.create(model=model, messages=ask, max_tokens=60, temperature=0, tools=[weather],
                                       tool_choice=named).choices[0].message.tool_calls[0]
check(json.loads(whole.function.arguments) == json.loads(calls[0]["arguments"]), "streamed call == whole call")
loop = ask + [{"role": "assistant", "content": None, "tool_calls": [
    {"id": whole.id, "type": "function", "function": {"name": "get_weather", "arguments": whole.function.arguments}}]},
    {"role": "tool", "tool_call_id": whole.id, "content": "18 degrees and sunny"}]
answer = client.chat.completions.create(model=model, messages=loop, max_tokens=40, temperature=0, tools=[weather])
m = answer.choices[0].message
check(bool(m.content) or bool(m.tool_calls), f"tool loop answered: {m}")
auto = client.chat.completions.create(model=model, messages=ask, max_tokens=60, temperature=0, tools=[weather]).choices[0]
check(auto.finish_reason in ("stop", "length") and auto.message.content or auto.finish_reason == "tool_calls"
      and all(json.loads(t.function.arguments) is not None for t in auto.message.tool_calls), f"auto: {auto}")

# Log-probabilities, whole and streamed: one entry per generated token, greedy's token at the top
# of its alternatives, the entries' text spelling the answer; the same entries when streamed.
lp = client.chat.completions.create(model=model, messages=question, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
content = lp.choices[0].logprobs.content
check(len(content) == lp.usage.completion_tokens, f"{len(content)} logprob entries for {lp.usage.completion_tokens} tokens")
check(all(e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in content), "entries")
check("".join(e.token for e in content) == lp.choices[0].message.content, "entries spell the text")
check(bytes(content[0].bytes).decode() == content[0].token, "bytes")
streamed_lp = [e for c in client.chat.completions.create(model=model, messages=question, max_tokens=12, temperature=0,
               logprobs=True, top_logprobs=2, stream=True) if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
check([e.token for e in streamed_lp] == [e.token for e in content], "streamed entries")
check(r.choices[0].logprobs is None, "none unless asked")

# Text completions' logprobs in the legacy shape: one entry per token, the tokens spell the text,
# the offsets place them in it, the greedy token leads its alternatives; streamed the same.
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2)
l = c.choices[0].logprobs
check(len(l.tokens) == c.usage.completion_tokens == 6 and "".join(l.tokens) == c.choices[0].text, f"legacy tokens {l.tokens}")
check(l.text_offset == [sum(len(t) for t in l.tokens[:i]) for i in range(6)], f"text_offset {l.text_offset}")
check(all(len(top) <= 2 and max(top.values()) == lp for top, lp in zip(l.top_logprobs, l.token_logprobs)), "alternatives")
sl = [e for x in client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
      logprobs=2, stream=True) if x.choices and x.choices[0].logprobs for e in zip(
      x.choices[0].logprobs.tokens, x.choices[0].logprobs.text_offset)]
check(sl == list(zip(l.tokens, l.text_offset)), f"streamed legacy logprobs {sl}")

# echo (what lm-evaluation-harness's loglikelihood asks for): the prompt comes back before the
# completion, with an entry for each prompt token (the first null: nothing precedes it) ahead of
# the completion's; max_tokens=0 scores the prompt alone; a batch of one token-id prompt (as
# lm-eval sends it) the same way.
e = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0,
                              logprobs=2, echo=True)
el, n = e.choices[0].logprobs, e.usage.prompt_tokens
check(e.choices[0].text == "The capital of France is" + c.choices[0].text, f"echo text {e.choices[0].text!r}")
check(len(el.tokens) == n + 6 and el.token_logprobs[0] is None and el.top_logprobs[0] is None, "echo entries")
check(el.tokens[n:] == l.tokens and all(abs(a - b) < 1e-3 for a, b in zip(el.token_logprobs[n:], l.token_logprobs)),
      "the completion's entries as without echo")
check(all(lp <= 0 and max(top.values()) >= lp - 1e-6 for lp, top in zip(el.token_logprobs[1:n], el.top_logprobs[1:n])),
      "prompt entries")
z = client.completions.create(model=model, prompt="The capital of France is", max_tokens=0, temperature=0,
                              logprobs=1, echo=True)
zl = z.choices[0].logprobs
check(z.choices[0].text == "The capital of France is" and z.usage.completion_tokens == 0 and len(zl.tokens) == n,
      f"max_tokens=0 echoes the prompt alone: {z.choices[0].text!r} {z.usage}")
check(all(abs(a - b) < 1e-3 for a, b in zip(zl.token_logprobs[1:], el.token_logprobs[1:n])), "the same prompt entries")
t = client.completions.create(model=model, prompt=[[504, 3575, 282, 4649, 314]], max_tokens=1, temperature=0,
                              logprobs=1, echo=True)
check(len(t.choices[0].logprobs.tokens) == 6 and t.usage.prompt_tokens == 5, "a token-id prompt in a batch of one")
for kwargs, what in [(dict(stream=True), "echo is not supported with stream"),
                     (dict(prompt=[[1, 2], [3, 4]]), "one prompt per request")]:
    try:
        client.completions.create(**{**dict(model=model, prompt="Hi", max_tokens=2, echo=True), **kwargs})
        check(False, what)
    except openai.BadRequestError as err:
        check(what in str(err), what)

# Errors come back as the client's exception types, with the server's message.
for kwargs, exc, what in [
    (dict(top_p=7), openai.BadRequestError, "top_p"),
    (dict(temperature=-1), openai.BadRequestError, "temperature"),
    (dict(max_tokens=10**6), openai.BadRequestError, "context"),
    (dict(top_logprobs=3), openai.BadRequestError, "top_logprobs needs logprobs"),
    (dict(logprobs=True, top_logprobs=21), openai.BadRequestError, "at most 20"),
]:
    try:
        client.chat.completions.create(model=model, messages=question, **{"max_tokens": 4, **kwargs})
        check(False, f"{kwargs} refused")
    except exc as e:
        check(what in str(e), f"{kwargs}: {type(e).__name__}")
try:
    client.chat.completions.create(model="no-such-model", messages=question, max_tokens=4)
    check(False, "unknown model refused")
except openai.NotFoundError as e:
    check(e.code == "model_not_found" and "no-such-model" in str(e), "unknown model: NotFoundError")
print("all passed")
