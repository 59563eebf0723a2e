// The Node clients people point at OpenAI-compatible servers — the official `openai` package and
// the Vercel AI SDK (generateText, streamText, generateObject, tools) — against a running
// `veloq serve` (started by tests/serve.rs).
//
//     node clients.mjs http://127.0.0.1:PORT/v1 MODEL_ID
//
// Exits non-zero with a message on the first check that fails.

import OpenAI from "openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateObject, generateText, streamText, tool } from "ai";
import { z } from "zod";

const [base, model] = process.argv.slice(2);

function check(cond, what) {
  if (!cond) {
    console.log(`FAILED: ${what}`);
    process.exit(1);
  }
  console.log(`ok: ${what}`);
}

const question = [{ role: "user", content: "What is the capital of France? Answer in one word." }];

// The official Node client: whole, streamed (the deltas spell the whole answer), a forced tool call.
const client = new OpenAI({ baseURL: base, apiKey: "unused", maxRetries: 0 });
const whole = await client.chat.completions.create({ model, messages: question, max_tokens: 12, temperature: 0 });
const text = whole.choices[0].message.content;
check(text.includes("Paris"), `openai chat ${JSON.stringify(text)}`);
let streamed = "";
for await (const c of await client.chat.completions.create({
  model, messages: question, max_tokens: 12, temperature: 0, stream: true,
})) {
  streamed += c.choices[0]?.delta?.content ?? "";
}
check(streamed === text, `openai stream ${JSON.stringify(streamed)}`);
const weather = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Current weather in a city",
    parameters: { type: "object", properties: { city: { type: "string", maxLength: 40 } }, required: ["city"] },
  },
};
const called = await client.chat.completions.create({
  model, messages: [{ role: "user", content: "Weather in Paris?" }], max_tokens: 60, temperature: 0,
  tools: [weather], tool_choice: "required",
});
const call = called.choices[0].message.tool_calls[0];
check(called.choices[0].finish_reason === "tool_calls" && call.function.name === "get_weather"
  && typeof JSON.parse(call.function.arguments).city === "string", `openai tool call ${JSON.stringify(call)}`);

// The AI SDK through its OpenAI-compatible provider.
const veloq = createOpenAICompatible({ name: "veloq", baseURL: base, apiKey: "unused", supportsStructuredOutputs: true });
const g = await generateText({ model: veloq(model), prompt: "What is the capital of France? Answer in one word.",
  maxOutputTokens: 12, temperature: 0 });
check(g.text.includes("Paris") && g.usage.outputTokens > 0, `generateText ${JSON.stringify(g.text)}`);
const s = streamText({ model: veloq(model), prompt: "Count from one to five.", maxOutputTokens: 24, temperature: 0 });
let parts = 0;
let all = "";
for await (const delta of s.textStream) {
  parts += 1;
  all += delta;
}
check(parts > 1 && all === (await s.text), `streamText: ${parts} parts, ${JSON.stringify(all)}`);
const o = await generateObject({
  model: veloq(model),
  schema: z.object({ city: z.string().max(40), population: z.number().int().min(0).max(100000000) }),
  prompt: "Name the capital of France and its population.",
  maxOutputTokens: 120,
  temperature: 0,
});
check(typeof o.object.city === "string" && Number.isInteger(o.object.population), `generateObject ${JSON.stringify(o.object)}`);
const t = await generateText({
  model: veloq(model),
  prompt: "What is the weather in Paris?",
  tools: { get_weather: tool({ description: "Current weather in a city", inputSchema: z.object({ city: z.string().max(40) }) }) },
  toolChoice: "required",
  maxOutputTokens: 60,
  temperature: 0,
});
check(t.toolCalls.length === 1 && t.toolCalls[0].toolName === "get_weather" && typeof t.toolCalls[0].input.city === "string",
  `AI SDK tool call ${JSON.stringify(t.toolCalls)}`);
console.log("all passed");
