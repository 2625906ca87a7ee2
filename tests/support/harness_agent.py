"""An agent program as a stranger writes one: the `openai` SDK configured from the environment
(OPENAI_BASE_URL, OPENAI_API_KEY), a hard-coded model name, its own loop: a question, then a
follow-up streamed. It prints the last answer. Nothing of art is imported."""

from openai import OpenAI

client = OpenAI()
messages = [{"role": "system", "content": "Answer in a few words."},
            {"role": "user", "content": "Name a colour."}]
first = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=12,
                                       temperature=1.0)
messages += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And one more?"}]
stream = client.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=12,
                                        temperature=1.0, stream=True)
print("".join(c.choices[0].delta.content or "" for c in stream if c.choices), end="")
