"""The agent race's task (benchmarks/vs_trl_agent.py; also rollout_profile.py and
pipeline_vs_sync.py): the demo's made-up countries (art_langgraph/demo.py), a `lookup_country`
tool that returns a country's record, the demo's system prompt and two worked examples before
the question.

`single`: "What is the currency of X?", a lookup and an answer (<= 2 model calls). `multi`:
"Which has the larger population, A or B?" or "What are the currencies of A and B?", two
lookups and an answer (<= 3 model calls). Reward, from the demo's world data: 0.8 x correct +
0.2 x share of the question's countries looked up; correct = single: the demo's rule; larger:
the first of the two countries the answer names is the more populous, and its population is
given; currencies: both named.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from art_langgraph import demo

LOOKUPS = {"single": 1, "multi": 2}  # tool calls an episode needs; the answer is one more call


@dataclass(frozen=True)
class Task:
    kind: str  # "field" (single), "larger" or "currencies" (multi)
    countries: tuple[str, ...]
    field: str = ""

    @property
    def text(self) -> str:  # demo.prompt(q) reads only q.text
        a, b = self.countries[0], self.countries[-1]
        return {"field": f"What is the {self.field} of {a}?",
                "larger": f"Which has the larger population, {a} or {b}?",
                "currencies": f"What are the currencies of {a} and {b}?"}[self.kind]


def all_tasks(task: str, countries: list[str] | None = None) -> list[Task]:
    """The questions in a fixed order, about `countries` (default: the demo's training
    countries; the held-out ones make held-out questions)."""
    countries = demo.TRAIN_COUNTRIES if countries is None else countries
    if task == "single":
        return [Task("field", (q.country,), q.field) for q in demo.questions(countries)]
    out = []
    for i, a in enumerate(countries):
        b = countries[(i + 5) % len(countries)]
        kind = "larger" if i % 2 == 0 else "currencies"
        if kind == "larger" and population(a) == population(b):
            kind = "currencies"
        out.append(Task(kind, (a, b)))
    return out


def step_tasks(task: str, step: int, groups: int) -> list[Task]:
    """The questions of step `step`, identical for every system."""
    tasks = all_tasks(task)
    return [tasks[(step * groups + g) % len(tasks)] for g in range(groups)]


def population(country: str) -> int:
    return int(demo.WORLD[country]["population"].split()[0])


def score(task: Task, looked_up: list[str], answer: str) -> float:
    """The episode's reward from the countries it looked up and its final answer text."""
    found = sum(c in looked_up for c in task.countries) / len(task.countries)
    text = answer.lower()
    if task.kind == "field":
        record = demo.WORLD[task.countries[0]]
        correct = record[task.field].lower() in text and not any(
            v.lower() in text for f, v in record.items() if f != task.field)
    elif task.kind == "currencies":
        correct = all(demo.WORLD[c]["currency"].lower() in text for c in task.countries)
    else:
        named = [c for c in task.countries if c.lower() in text]  # first: the one it picks
        winner = max(task.countries, key=population)
        correct = bool(named) and min(named, key=lambda c: text.find(c.lower())) == winner \
            and demo.WORLD[winner]["population"] in text  # with its figure: not a coin toss
    return 0.8 * correct + 0.2 * found


def episode(messages: list[dict[str, Any]]) -> tuple[list[str], str, int]:
    """(countries looked up, final answer, model calls) from an episode's messages after the
    question, OpenAI format: TRL's parsed completion (arguments a dict), or ours (a string)."""
    turns = [m for m in messages if m.get("role") == "assistant"]
    looked_up = []
    for call in (c for m in turns for c in m.get("tool_calls") or []):
        args = call.get("function", {}).get("arguments")
        with contextlib.suppress(ValueError):
            args = json.loads(args) if isinstance(args, str) else args
        if isinstance(args, dict):
            looked_up.append(str(args.get("country", "")).strip())
    last = turns[-1] if turns else {}
    return looked_up, "" if last.get("tool_calls") else str(last.get("content") or ""), len(turns)


def lookup_country(country: str):  # no return annotation: the schema stays the wire's
    """Look up a country's record: its capital, currency and population.

    Args:
        country: The country's name.
    """
    return demo.lookup_country.func(country)


# ---- the agent: LangGraph, as the demo's ---------------------------------------------------


def build_agent(llm: Any, lookups: int, tool: Any = None) -> Any:
    """model -> tools -> model, as the demo's build_agent: the first `lookups` turns must call
    the tool, at most `lookups + 1` model turns (TRL's max_tool_calling_iterations + 1).
    `tool`: what runs the calls (default: the demo's `lookup_country`)."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(lookup_country)  # what TRL renders for the callable
    must_call = llm.bind_tools([schema], tool_choice="required")
    may_call = llm.bind_tools([schema])

    async def agent(state: MessagesState) -> dict[str, Any]:
        done = sum(isinstance(m, ToolMessage) for m in demo.this_question(state["messages"]))
        llm = must_call if done < lookups else may_call
        return {"messages": [await llm.ainvoke(state["messages"])]}

    def next_step(state: MessagesState) -> str:
        turns = sum(isinstance(m, AIMessage) for m in demo.this_question(state["messages"]))
        return "tools" if state["messages"][-1].tool_calls and turns <= lookups else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([tool or demo.lookup_country]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", next_step, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile()
