// Drives the server with Continue's client library, unchanged (tests/test_clients.py).
// Usage: node drive.mjs BASE_URL API_KEY MODEL CALL...
//   CALL: completion (the openai provider's completionStream, prompt + suffix),
//         llamacpp (the llama.cpp provider's completionStream),
//         fim (the mistral provider's fimStream, Continue's FIM path).
// Prints one JSON line per call: {call, ok, text, chunks, finish} or {call, ok, error}.
import { constructLlmApi } from "@continuedev/openai-adapters";

const [base, apiKey, model, ...calls] = process.argv.slice(2);
const v1 = base.replace(/\/+$/, "") + "/v1/";    // Continue's apiBase for these providers
const prompt = "def add(a, b):\n    return ";
const suffix = "\n\nprint(add(1, 2))\n";

function api(provider) {
  return constructLlmApi({ provider, apiBase: v1, apiKey });
}

async function collect(stream) {
  let text = "", chunks = 0, finish = null;
  for await (const chunk of stream) {
    const choice = chunk.choices?.[0] ?? {};
    chunks += 1;
    text += choice.text ?? choice.delta?.content ?? "";
    finish = choice.finish_reason ?? finish;
  }
  return { text, chunks, finish };
}

const run = {
  completion: (signal) => collect(api("openai").completionStream(
    { model, prompt, suffix, max_tokens: 8, temperature: 0, stream: true }, signal)),
  llamacpp: (signal) => collect(api("llama.cpp").completionStream(
    { model, prompt, max_tokens: 8, temperature: 0, stream: true }, signal)),
  fim: (signal) => collect(api("mistral").fimStream(
    { model, prompt, suffix, max_tokens: 8, temperature: 0, top_p: 1,
      frequency_penalty: 0, presence_penalty: 0, stop: ["\n\n\n"], stream: true }, signal)),
};

let failed = false;
for (const call of calls) {
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), 120000);
  try {
    console.log(JSON.stringify({ call, ok: true, ...(await run[call](abort.signal)) }));
  } catch (error) {
    failed = true;
    console.log(JSON.stringify({ call, ok: false, error: String(error?.message ?? error) }));
  } finally {
    clearTimeout(timer);
  }
}
process.exit(failed ? 1 : 0);
