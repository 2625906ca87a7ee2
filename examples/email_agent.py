"""A small ART·E: an agent answers questions about an inbox by searching and reading emails.

    python examples/email_agent.py               # GPU: Qwen2.5-7B-Instruct, 40 steps
    python examples/email_agent.py --cpu-smoke   # any laptop: the embedded SmolLM2, 2 tiny steps

The inbox is synthetic, generated here from a seed (no downloads): flight confirmations,
invoices, meeting changes and shipping notices among newsletters, stored in SQLite with an FTS5
full-text index. The agent has three tools, `search_inbox(keywords)`, `read_email(id)` and
`answer(text)`, and must call one each turn (`tool_choice="required"`: the gateway holds every
reply to a valid call). Each question has a known answer; the reward is 1 when the final answer
contains it, plus 0.1 for having opened the email that holds it (partial credit, so early
training finds some signal). Held-out questions are never trained on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sqlite3
from dataclasses import dataclass

import art_core as art

TOOLS = [
    {"type": "function", "function": {
        "name": "search_inbox", "description": "Full-text search of the inbox; returns ids, "
        "senders, subjects and snippets of the best matches.",
        "parameters": {"type": "object", "required": ["keywords"], "additionalProperties": False,
                       "properties": {"keywords": {"type": "string", "maxLength": 60}}}}},
    {"type": "function", "function": {
        "name": "read_email", "description": "The full text of one email, by id.",
        "parameters": {"type": "object", "required": ["id"], "additionalProperties": False,
                       "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}}}}},
    {"type": "function", "function": {
        "name": "answer", "description": "Give the final answer to the question.",
        "parameters": {"type": "object", "required": ["text"], "additionalProperties": False,
                       "properties": {"text": {"type": "string", "maxLength": 60}}}}},
]
SYSTEM = ("You answer questions about the user's email inbox. Search it with search_inbox, open "
          "an email with read_email, then call answer with a short answer.")


@dataclass
class Config:
    base_model: str
    steps: int
    groups_per_step: int  # questions per step
    rollouts_per_group: int
    max_turns: int
    learning_rate: float
    eval_questions: int  # held-out questions scored before and after training


GPU = Config("Qwen/Qwen2.5-7B-Instruct", steps=40, groups_per_step=8, rollouts_per_group=6,
             max_turns=8, learning_rate=1e-5, eval_questions=10)
CPU_SMOKE = Config(art.DEFAULT_BASE_MODEL, steps=2, groups_per_step=1, rollouts_per_group=3,
                   max_turns=2, learning_rate=1e-3, eval_questions=0)


@dataclass
class Question:
    text: str
    answer: str
    email_id: int


# ---- the synthetic inbox ----------------------------------------------------------------------

CITIES = ["Lisbon", "Oslo", "Denver", "Nairobi", "Kyoto", "Lima", "Dublin", "Perth", "Quito",
          "Hanoi"]
VENDORS = ["Acme Hosting", "Blue Print Co", "Northwind", "Sunrise Catering", "Vertex Legal",
           "Greenleaf Gardens", "Harbor Insurance", "Pixel Studio"]
PEOPLE = ["Maria", "Tom", "Priya", "Jonas", "Aiko", "Samuel", "Lena", "Omar"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
ITEMS = ["desk lamp", "backpack", "coffee grinder", "keyboard", "rain jacket", "tent",
         "blender", "monitor"]
STOPWORDS = {"a", "an", "the", "is", "of", "my", "to", "our", "on", "from", "what", "which",
             "did", "how", "much", "me", "i", "in", "for", "and", "email"}
TOPICS = ["weather", "markets", "sport", "science", "travel deals", "recipes"]


def _facts(rng: random.Random) -> list[tuple[str, str, str, str, str]]:
    """(sender, subject, body, question, answer): one email per city, vendor, person, item, so
    every question has exactly one email that answers it."""
    facts = []
    for city in CITIES:
        code = "".join(rng.choices("ABCDEFGHJKLMNPRSTUVWXYZ", k=6))
        facts.append(("bookings@skyway.example", f"Your flight to {city} is confirmed",
                      f"Thank you for booking. Flight to {city}, confirmation code {code}.",
                      f"What is the confirmation code of my flight to {city}?", code))
    for vendor in VENDORS:
        amount = f"${rng.randint(20, 2000)}"
        facts.append((f"billing@{vendor.split()[0].lower()}.example", f"Invoice from {vendor}",
                      f"Your invoice from {vendor} is ready. Total due: {amount}.",
                      f"How much is due on the invoice from {vendor}?", amount))
    for person in PEOPLE:
        day = rng.choice(DAYS)
        facts.append((f"{person.lower()}@work.example", f"Meeting with {person} moved",
                      f"Hi, {person} here. I moved our meeting to {day} at 10am.",
                      f"To which day did {person} move our meeting?", day))
    for item in ITEMS:
        number = str(rng.randint(100000, 999999))
        facts.append(("orders@shop.example", f"Your {item} has shipped",
                      f"Good news: your {item} is on its way. Tracking number {number}.",
                      f"What is the tracking number of my {item}?", number))
    return facts


class Inbox:
    """Emails in SQLite with an FTS5 index, and the questions they answer."""

    def __init__(self, seed: int = 0, newsletters: int = 30) -> None:
        rng = random.Random(seed)
        emails = [(*f, True) for f in _facts(rng)] + [
            ("news@daily.example", f"Daily digest #{n}",
             f"Top stories: {rng.choice(CITIES)} {rng.choice(TOPICS)}, {rng.choice(TOPICS)}.",
             "", "", False) for n in range(newsletters)]
        rng.shuffle(emails)
        self.db = sqlite3.connect(":memory:")
        self.db.execute("CREATE VIRTUAL TABLE emails USING fts5(sender, subject, body)")
        self.questions: list[Question] = []
        for i, (sender, subject, body, question, answer, is_fact) in enumerate(emails, 1):
            self.db.execute("INSERT INTO emails(rowid, sender, subject, body) VALUES (?,?,?,?)",
                            (i, sender, subject, body))
            if is_fact:
                self.questions.append(Question(question, answer, i))
        rng.shuffle(self.questions)

    def search(self, keywords: str) -> str:
        words = [w for w in re.findall(r"[A-Za-z0-9$]+", keywords)
                 if w.lower() not in STOPWORDS][:10]
        if not words:
            return "[]"
        rows = []
        for op in (" AND ", " OR "):  # every word if possible, else any word
            query = op.join(f'"{w}"' for w in words)  # quoted: no FTS5 syntax gets through
            rows = self.db.execute(
                "SELECT rowid, sender, subject, snippet(emails, 2, '', '', '...', 10) "
                "FROM emails WHERE emails MATCH ? ORDER BY rank LIMIT 3", (query,)).fetchall()
            if rows:
                break
        return json.dumps([{"id": r[0], "from": r[1], "subject": r[2], "snippet": r[3]}
                           for r in rows])

    def read(self, email_id: int) -> str:
        row = self.db.execute("SELECT sender, subject, body FROM emails WHERE rowid = ?",
                              (email_id,)).fetchone()
        return f"From: {row[0]}\nSubject: {row[1]}\n\n{row[2]}" if row else "No such email."


# ---- the rollout and the loop -----------------------------------------------------------------

async def rollout(model: art.TrainableModel, inbox: Inbox, q: Question, cfg: Config
                  ) -> art.Trajectory:
    client = model.openai_client()
    traj = art.Trajectory(tools=TOOLS, messages=[{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": q.text}])
    answer, opened = None, set()
    for _ in range(cfg.max_turns):
        response = await client.chat.completions.create(
            model=model.name, messages=traj.messages, tools=TOOLS, tool_choice="required",
            max_tokens=96, temperature=1.0)
        message = traj.add_completion(response)
        if not message.get("tool_calls"):
            break  # cut off by max_tokens
        call = message["tool_calls"][0]
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        if name == "answer":
            answer = args["text"]
            break
        if name == "read_email":
            opened.add(args["id"])
            result = inbox.read(args["id"])
        else:
            result = inbox.search(args["keywords"])
        traj.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    correct = answer is not None and q.answer.lower() in answer.lower()
    traj.reward = float(correct) + 0.1 * (q.email_id in opened)
    traj.metrics.update(correct=correct, read_source=q.email_id in opened,
                        answered=answer is not None, turns=len(traj.turns))
    return traj


async def evaluate(model: art.TrainableModel, inbox: Inbox, questions: list[Question],
                   cfg: Config) -> float:
    """Share of held-out questions answered correctly (one rollout each)."""
    trajs = await art.gather_trajectories(rollout(model, inbox, q, cfg) for q in questions)
    return sum(bool(t.metrics["correct"]) for t in trajs) / max(1, len(trajs))


async def train(model: art.TrainableModel, cfg: Config, seed: int = 0) -> list[float]:
    """The RL loop on the training questions; returns the mean reward of each step."""
    inbox = Inbox(seed)
    held_out = inbox.questions[:cfg.eval_questions]
    training = inbox.questions[cfg.eval_questions:]
    if held_out:
        print(f"held-out accuracy before: {await evaluate(model, inbox, held_out, cfg):.2f}")
    means = []
    start = await model.get_step()
    for step in range(start, start + cfg.steps):
        batch = [training[(step * cfg.groups_per_step + g) % len(training)]
                 for g in range(cfg.groups_per_step)]
        groups = await art.gather_trajectory_groups(
            [rollout(model, inbox, q, cfg) for _ in range(cfg.rollouts_per_group)] for q in batch)
        result = await model.train(groups, art.TrainConfig(learning_rate=cfg.learning_rate))
        means.append(result.metrics["reward_mean"])
        print(f"step {result.step}: mean reward {means[-1]:.3f}")
    if held_out:
        print(f"held-out accuracy after: {await evaluate(model, inbox, held_out, cfg):.2f}")
    return means


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny run on the embedded model")
    parser.add_argument("--path", default=".art", help="where runs and checkpoints are stored")
    args = parser.parse_args()
    cfg = CPU_SMOKE if args.cpu_smoke else GPU
    async with art.LocalBackend(args.path) as backend:
        model = art.TrainableModel(name="email-smoke" if args.cpu_smoke else "email-agent",
                                   project="examples", base_model=cfg.base_model)
        await model.register(backend)
        await train(model, cfg)


if __name__ == "__main__":
    asyncio.run(main())
