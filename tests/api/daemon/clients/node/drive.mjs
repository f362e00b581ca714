// The npm `openai` and `ollama` packages against a running localai daemon, as their users call them:
// `node drive.mjs CLIENT BASE_URL` prints one JSON object of check outcomes, as tests/api/daemon/clients/drive.py does.
import { Ollama } from "ollama";
import OpenAI from "openai";
import zlib from "node:zlib";

const MODEL = "smollm2";
const AGENT = "agent"; // the scripted model: a tool call, then an answer once the tool's result is back
const CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>';
const ANSWER = "It is sunny in Paris.";
const TOOL_PROMPT = `What is the weather in Paris? [[turns:${CALL}|||${ANSWER}]]`;
const CHECKS = ["models", "plain", "stream", "tools", "structured", "embed", "image", "logprobs", "rerank"];
// each generated token's logprob as the client hands it over: tokens that spell the text, logprobs <= 0
const logprobEntries = (entries, text) => expect(entries.length > 0 && entries.map((e) => e.token).join("") === text
  && entries.every((e) => e.logprob <= 0), entries.slice(0, 4).map((e) => e.token));
const CAPITAL = {
  type: "object", additionalProperties: false, required: ["capital", "in_europe"],
  properties: { capital: { type: "string", enum: ["Paris", "Lyon", "Nice"] }, in_europe: { type: "boolean" } },
};
const WEATHER = { type: "object", properties: { city: { type: "string" } }, required: ["city"] };

function png() {
  const crcTable = Array.from({ length: 256 }, (_, n) => {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    return c >>> 0;
  });
  const crc = (buf) => { let c = 0xffffffff; for (const b of buf) c = crcTable[(c ^ b) & 0xff] ^ (c >>> 8); return (c ^ 0xffffffff) >>> 0; };
  const chunk = (kind, data) => {
    const head = Buffer.alloc(4); head.writeUInt32BE(data.length);
    const tail = Buffer.alloc(4); tail.writeUInt32BE(crc(Buffer.concat([Buffer.from(kind), data])));
    return Buffer.concat([head, Buffer.from(kind), data, tail]);
  };
  const ihdr = Buffer.alloc(13); ihdr.writeUInt32BE(4, 0); ihdr.writeUInt32BE(4, 4); ihdr[8] = 8; ihdr[9] = 2;
  const row = Buffer.concat([Buffer.from([0]), Buffer.from([200, 30, 30, 200, 30, 30, 200, 30, 30, 200, 30, 30])]);
  return Buffer.concat([Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]), chunk("IHDR", ihdr),
    chunk("IDAT", zlib.deflateSync(Buffer.concat([row, row, row, row]))), chunk("IEND", Buffer.alloc(0))]);
}
const PNG_B64 = png().toString("base64");

function expect(condition, detail) {
  if (!condition) throw new Error(`unexpected: ${JSON.stringify(detail)}`.slice(0, 500));
  return detail;
}

const listed = (names) => names.some((n) => n.split(":")[0] === MODEL) && names.some((n) => n.split(":")[0] === AGENT);

async function run(checks) {
  const results = {};
  for (const name of CHECKS) {
    if (!checks[name]) { results[name] = null; continue; }
    try {
      const value = await checks[name]();
      results[name] = { ok: Boolean(value), detail: String(typeof value === "object" ? JSON.stringify(value) : value).slice(0, 300) };
    } catch (error) {
      results[name] = { ok: false, detail: `${error.name}: ${error.message}`.slice(0, 600) };
    }
  }
  return results;
}

function openaiChecks(base) {
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });
  const ask = (content, extra = {}) => client.chat.completions.create({
    model: MODEL, max_tokens: 16, temperature: 0, messages: [{ role: "user", content }], ...extra });
  return run({
    models: async () => expect(listed((await client.models.list()).data.map((m) => m.id)), "listed"),
    plain: async () => (await ask("Say hello.")).choices[0].message.content,
    stream: async () => {
      let text = "";
      for await (const chunk of await ask("Count to three.", { stream: true })) text += chunk.choices[0]?.delta?.content ?? "";
      return text;
    },
    tools: async () => {
      const tools = [{ type: "function", function: { name: "get_weather", description: "Current weather", parameters: WEATHER } }];
      const messages = [{ role: "user", content: TOOL_PROMPT }];
      const first = await client.chat.completions.create({ model: AGENT, messages, tools });
      const call = first.choices[0].message.tool_calls[0];
      messages.push(first.choices[0].message, { role: "tool", tool_call_id: call.id, content: "sunny, 22 C" });
      const final = await client.chat.completions.create({ model: AGENT, messages, tools });
      return expect(final.choices[0].message.content === ANSWER, call.function.name);
    },
    structured: async () => {
      const reply = await ask("What is the capital of France?", { max_tokens: 48,
        response_format: { type: "json_schema", json_schema: { name: "capital", strict: true, schema: CAPITAL } } });
      const value = JSON.parse(reply.choices[0].message.content);
      return expect(["Paris", "Lyon", "Nice"].includes(value.capital), value);
    },
    embed: async () => (await client.embeddings.create({ model: MODEL, input: "hello world" })).data[0].embedding.length,
    image: async () => (await ask([{ type: "text", text: "What is in this picture?" },
      { type: "image_url", image_url: { url: `data:image/png;base64,${PNG_B64}` } }])).choices[0].message.content,
    logprobs: async () => {
      const reply = await ask("Say hello.", { logprobs: true, top_logprobs: 2 });
      return logprobEntries(reply.choices[0].logprobs.content, reply.choices[0].message.content);
    },
  });
}

function ollamaChecks(base) {
  const client = new Ollama({ host: base });
  const options = { num_predict: 16, temperature: 0 };
  return run({
    models: async () => expect(listed((await client.list()).models.map((m) => m.model)), "listed"),
    plain: async () => (await client.chat({ model: MODEL, options, messages: [{ role: "user", content: "Say hello." }] })).message.content,
    stream: async () => {
      let text = "";
      for await (const part of await client.chat({ model: MODEL, options, stream: true, messages: [{ role: "user", content: "Count to three." }] })) text += part.message.content;
      return text;
    },
    tools: async () => {
      const tools = [{ type: "function", function: { name: "get_weather", description: "Current weather", parameters: WEATHER } }];
      const messages = [{ role: "user", content: TOOL_PROMPT }];
      const first = await client.chat({ model: AGENT, messages, tools });
      const call = first.message.tool_calls[0];
      messages.push(first.message, { role: "tool", tool_name: call.function.name, content: "sunny, 22 C" });
      const final = await client.chat({ model: AGENT, messages, tools });
      return expect(final.message.content === ANSWER, call.function.name);
    },
    structured: async () => {
      const reply = await client.chat({ model: MODEL, format: CAPITAL, options: { num_predict: 48, temperature: 0 },
        messages: [{ role: "user", content: "What is the capital of France?" }] });
      const value = JSON.parse(reply.message.content);
      return expect(["Paris", "Lyon", "Nice"].includes(value.capital), value);
    },
    embed: async () => (await client.embed({ model: MODEL, input: "hello world" })).embeddings[0].length,
    image: async () => (await client.chat({ model: MODEL, options, messages: [
      { role: "user", content: "What is in this picture?", images: [PNG_B64] }] })).message.content,
    logprobs: async () => {
      const reply = await client.chat({ model: MODEL, options, logprobs: true, top_logprobs: 2,
        messages: [{ role: "user", content: "Say hello." }] });
      return logprobEntries(reply.logprobs, reply.message.content);
    },
  });
}

const [client, base] = process.argv.slice(2);
const drive = { "npm-openai": openaiChecks, "npm-ollama": ollamaChecks }[client];
console.log(JSON.stringify(await drive(base.replace(/\/$/, ""))));
