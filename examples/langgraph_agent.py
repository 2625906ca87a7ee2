"""A LangGraph agent like any other, made trainable by adding one callback.

    .venv/bin/python examples/langgraph_agent.py            # 6 steps on the embedded model (CPU)
    .venv/bin/python examples/langgraph_agent.py --cpu-smoke # 2 tiny steps

The agent answers questions about a small (made-up, so the model cannot know it) table of
countries with a `lookup_country` tool: model -> ToolNode -> model. The only RL-specific lines
are marked `# RL`: the chat model comes from `init_chat_model(model)` (any ChatOpenAI pointed at
the gateway works too), each rollout passes a `TrajectoryRecorder` in the config, and the groups
go to `model.train`. The reward checks the final answer against the table.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

import art_core as art
from art_langgraph import TrajectoryRecorder, init_chat_model

COUNTRIES = {
    "Zarnia": {"capital": "Velmor", "currency": "drem", "language": "Zarnish"},
    "Quellen": {"capital": "Ostrava Nine", "currency": "quell", "language": "Quellic"},
    "Borovia": {"capital": "Tamsk", "currency": "borin", "language": "Borovian"},
    "Ilmaris": {"capital": "Saarport", "currency": "ilm", "language": "Ilmari"},
}
QUESTIONS = [(f"What is the {field} of {country}?", country, field)
             for country in COUNTRIES for field in ("capital", "currency")]


@tool
def lookup_country(country: str) -> str:
    """Look up a country's capital, currency and language."""
    row = COUNTRIES.get(country.strip())
    if row is None:
        return f"No country named {country!r}. Known: {', '.join(COUNTRIES)}."
    return f"{country}: " + "; ".join(f"{k} {v}" for k, v in row.items())


def build_agent(llm: Any) -> Any:
    """model -> tools -> model. The first turn must look something up (a strict tool call,
    which the gateway enforces even for a 135M model); then the model answers."""
    must_call = llm.bind_tools([lookup_country], tool_choice="required")
    may_call = llm.bind_tools([lookup_country])

    async def agent(state: MessagesState) -> dict[str, Any]:
        looked_up = any(isinstance(m, ToolMessage) for m in state["messages"])
        llm = may_call if looked_up else must_call
        return {"messages": [await llm.ainvoke(state["messages"])]}

    def next_step(state: MessagesState) -> str:
        turns = sum(isinstance(m, AIMessage) for m in state["messages"])
        return "tools" if state["messages"][-1].tool_calls and turns < 3 else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([lookup_country]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", next_step, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile()


SYSTEM = "Answer the user's question about a country. Look it up first, then answer in one sentence."


@dataclass
class Config:
    steps: int = 6
    rollouts_per_question: int = 4
    questions: int = 8
    max_tokens: int = 64
    learning_rate: float = 1e-3


CPU_SMOKE = Config(steps=2, rollouts_per_question=2, questions=2, max_tokens=48)


async def rollout(graph: Any, question: tuple[str, str, str]) -> art.Trajectory:
    text, country, field = question

    def reward(state: dict[str, Any]) -> float:
        answer = str(state["messages"][-1].content).lower()
        return float(COUNTRIES[country][field].lower() in answer)

    recorder = TrajectoryRecorder(reward=reward)  # RL: one callback records the rollout
    await graph.ainvoke({"messages": [("system", SYSTEM), ("user", text)]},
                        config={"callbacks": [recorder]})
    return await recorder.afinish()


async def train(model: art.TrainableModel, cfg: Config) -> list[float]:
    """Train for `cfg.steps` steps; returns the mean reward of each step's rollouts."""
    graph = build_agent(init_chat_model(model, max_tokens=cfg.max_tokens))  # RL: served model
    rewards = []
    for _ in range(cfg.steps):
        groups = await art.gather_trajectory_groups(
            [rollout(graph, q) for _ in range(cfg.rollouts_per_question)]
            for q in QUESTIONS[:cfg.questions])
        result = await model.train(groups, art.TrainConfig(learning_rate=cfg.learning_rate))  # RL
        rewards.append(result.metrics["reward_mean"])
        print(f"step {result.step}: reward {rewards[-1]:.2f}")
    return rewards


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="2 tiny steps")
    parser.add_argument("--path", default=".art", help="run directory")
    args = parser.parse_args()
    async with art.LocalBackend(args.path) as backend:
        model = art.TrainableModel(name="langgraph-agent", project="examples")
        await model.register(backend)
        await train(model, CPU_SMOKE if args.cpu_smoke else Config())


if __name__ == "__main__":
    asyncio.run(main())
