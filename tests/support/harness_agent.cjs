// An agent program as a stranger writes one, in Node: the `openai` npm package configured from
// the environment (OPENAI_BASE_URL, OPENAI_API_KEY), a hard-coded model name, its own loop: a
// question, then a follow-up streamed. It prints the last answer. Nothing of art is used.
const OpenAI = require("openai");

async function main() {
  const client = new OpenAI();
  const messages = [{ role: "system", content: "Answer in a few words." },
                    { role: "user", content: "Name a colour." }];
  const first = await client.chat.completions.create({
    model: "gpt-4o-mini", messages, max_tokens: 12, temperature: 1.0 });
  messages.push({ role: "assistant", content: first.choices[0].message.content },
                { role: "user", content: "And one more?" });
  const stream = await client.chat.completions.create({
    model: "gpt-4o-mini", messages, max_tokens: 12, temperature: 1.0, stream: true });
  let text = "";
  for await (const chunk of stream) {
    if (chunk.choices.length) text += chunk.choices[0].delta.content || "";
  }
  process.stdout.write(text);
}

main().catch((e) => { console.error(e); process.exit(1); });
