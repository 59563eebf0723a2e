"""LangChain's ChatOpenAI against a running `veloq serve` (started by tests/serve.rs): plain
invoke and stream, bind_tools with a forced call, with_structured_output by function calling and
by JSON schema.

    python3 langchain_client.py http://127.0.0.1:PORT/v1 MODEL_ID

Exits non-zero with a message on the first check that fails.
"""

import sys

import pydantic
from langchain_openai import ChatOpenAI

base, model = sys.argv[1], sys.argv[2]
llm = ChatOpenAI(base_url=base, api_key="unused", model=model, temperature=0, max_tokens=100, max_retries=0)


def check(cond, what):
    if not cond:
        sys.exit(f"FAILED: {what}")
    print(f"ok: {what}")


msg = llm.invoke("What is the capital of France? Answer in one word.")
check("Paris" in msg.content, f"invoke {msg.content!r}")
streamed = "".join(c.content for c in llm.stream("What is the capital of France? Answer in one word."))
check(streamed == msg.content, f"stream {streamed!r}")


class GetWeather(pydantic.BaseModel):
    """Current weather in a city."""

    city: str = pydantic.Field(max_length=40)


ai = llm.bind_tools([GetWeather], tool_choice="required").invoke("What is the weather in Paris?")
check(len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "GetWeather"
      and isinstance(ai.tool_calls[0]["args"]["city"], str), f"bind_tools: {ai.tool_calls}")


class City(pydantic.BaseModel):
    """A city and its population."""

    city: str = pydantic.Field(max_length=40)
    population: int = pydantic.Field(ge=0, le=100000000)


# json_mode is left out: it asks for any JSON object and relies on the model to pick the keys,
# which a 135M model does not; the two methods that pass the schema to the server always parse.
for method in ("function_calling", "json_schema"):
    out = llm.with_structured_output(City, method=method).invoke("Name the capital of France and its population.")
    check(isinstance(out, City), f"with_structured_output({method}): {out!r}")
print("all passed")
