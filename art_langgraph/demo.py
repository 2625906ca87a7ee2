"""`art demo`: a tool-using LangGraph agent gets more answers right, trained on a laptop CPU.

The task: answer questions such as "What is the currency of Velmoria?" about made-up countries
(so the model cannot know the answers) with a `lookup_country` tool that returns the country's
record. The agent is an ordinary LangGraph graph, model -> ToolNode -> model: its first turn must
call the tool (a forced call: the gateway holds it to the tool's schema; which country it names is
the model's choice), its next turn answers. It is made trainable by one callback,
`TrajectoryRecorder`.

    reward  = 0.8 x correct + 0.2 x looked up the right country
    correct = the answer names the value asked for and no other value of the record (echoing
              the whole record is not an answer)

Before the question the agent sees two worked examples (question, tool call, record, answer)
about other made-up countries, as agents in production are usually prompted. With them the
base model (SmolLM2-135M) answers about a third of the questions right; its usual mistake is to
give the field of an example instead of the one asked for. Measured alternatives, 72 questions
of the base model each: no examples, 6/72 right (it echoes the record or rambles, so most
groups of episodes score alike, GRPO has nothing to compare, and one of two 6-step runs did not
learn); one example, 51/72 (little left to learn). Each
step: `groups_per_step` training questions x `rollouts_per_group` episodes, GRPO on a LoRA,
hot-swap into vLLM. Before and after, the agent answers the held-out questions (countries never
seen in training) with the same sampling settings, and the demo prints the success rate with a
95% interval, one held-out episode from each, and writes a plot. A second run continues from the
last step (`--fresh` starts over).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from art_core import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_core.loop import EvalStats, load_eval_groups, sampling_text, train_loop
from art_core.model import TrainResult
from art_core.sampling import DEFAULT_BUDGET
from art_core.storage import read_jsonl
from art_langgraph.chat_model import init_chat_model
from art_langgraph.recorder import TrajectoryRecorder

FIELDS = ("capital", "currency", "population")
SYSTEM = ("You answer questions about countries. First call lookup_country with the country's "
          "name. Then answer in one short sentence with the value asked for, for example: "
          "The capital of Zarnia is Velmor.")
# Worked examples shown before each question: countries that are not in WORLD.
EXAMPLES = (("Zarnia", "currency", "Zarnia: capital Velmor; currency velmo; population 12 million",
             "The currency of Zarnia is velmo."),
            ("Ostrava", "population",
             "Ostrava: capital Kelmar; currency dano; population 41 million",
             "The population of Ostrava is 41 million."))
TEMPERATURE = 0.7  # the same for training rollouts and both evaluations
MAX_TOKENS = 64


def make_world(n: int = 24, seed: int = 7) -> dict[str, dict[str, str]]:
    """`n` made-up countries with a capital, a currency and a population (deterministic)."""
    rng = random.Random(seed)
    syll = ["ar", "bel", "cor", "dan", "el", "fen", "gor", "hal", "is", "jun", "kel", "lor",
            "mar", "nor", "ost", "pel", "quin", "ros", "sal", "tor", "ul", "var", "wen", "zan"]

    def word(k: int) -> str:
        return "".join(rng.choice(syll) for _ in range(k)).capitalize()

    world: dict[str, dict[str, str]] = {}
    while len(world) < n:
        name = word(2) + rng.choice(["ia", "land", "ova", "istan", "mark"])
        values = {"capital": word(2), "currency": word(1).lower() + rng.choice(["o", "en", "a"]),
                  "population": f"{rng.randint(2, 90)} million"}
        if name not in world and len({*values.values()}) == 3:
            world[name] = values
    return world


WORLD = make_world()
COUNTRIES = list(WORLD)
TRAIN_COUNTRIES, HELD_OUT_COUNTRIES = COUNTRIES[:16], COUNTRIES[16:]


@dataclass(frozen=True)
class Question:
    country: str
    field: str

    @property
    def text(self) -> str:
        return f"What is the {self.field} of {self.country}?"

    @property
    def answer(self) -> str:
        return WORLD[self.country][self.field]


def prompt(q: Question, worked_examples: bool = True) -> list[Any]:
    """The system prompt, the worked examples as earlier turns (unless left out), then the
    question."""
    msgs: list[Any] = [SystemMessage(SYSTEM)]
    for i, (country, field, record, answer) in enumerate(EXAMPLES if worked_examples else ()):
        call = {"id": f"example{i}", "name": "lookup_country", "args": {"country": country}}
        msgs += [HumanMessage(f"What is the {field} of {country}?"),
                 AIMessage("", tool_calls=[call]), ToolMessage(record, tool_call_id=call["id"]),
                 AIMessage(answer)]
    return [*msgs, HumanMessage(q.text)]


def questions(countries: list[str]) -> list[Question]:
    return [Question(c, f) for c in countries for f in FIELDS]


@tool
def lookup_country(country: str) -> str:
    """Look up a country's record: its capital, currency and population."""
    row = WORLD.get(country.strip())
    if row is None:
        return f"No country named {country!r}."
    return f"{country}: " + "; ".join(f"{k} {v}" for k, v in row.items())


def this_question(messages: list[Any]) -> list[Any]:
    """The messages after the last user message: the turns on the question being asked (the
    earlier turns are worked examples or history)."""
    last_user = max(i for i, m in enumerate(messages) if isinstance(m, HumanMessage))
    return messages[last_user + 1:]


def build_agent(llm: Any, tool: Any = lookup_country) -> Any:
    """model -> tools -> model, at most three model turns. `tool`: `lookup_country`, or a
    stand-in with its name and schema (a benchmark's slow copy of it)."""
    must_call = llm.bind_tools([tool], tool_choice="required")
    may_call = llm.bind_tools([tool])

    async def agent(state: MessagesState) -> dict[str, Any]:
        looked_up = any(isinstance(m, ToolMessage) for m in this_question(state["messages"]))
        llm = may_call if looked_up else must_call
        return {"messages": [await llm.ainvoke(state["messages"])]}

    def next_step(state: MessagesState) -> str:
        turns = sum(isinstance(m, AIMessage) for m in this_question(state["messages"]))
        return "tools" if state["messages"][-1].tool_calls and turns < 3 else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([tool]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", next_step, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile()


def score(messages: list[Any], q: Question) -> dict[str, float]:
    """The episode's reward and its parts, from the graph's final messages (the examples before
    the question do not count)."""
    turns = this_question(messages)
    calls = [c for m in turns if isinstance(m, AIMessage) for c in m.tool_calls]
    looked_up = any((c["args"] or {}).get("country") == q.country for c in calls)
    last = turns[-1] if turns else None  # no turn after the question: no answer
    answer = str(last.content).lower() if isinstance(last, AIMessage) and not last.tool_calls \
        else ""
    others = [v for f, v in WORLD[q.country].items() if f != q.field]
    correct = q.answer.lower() in answer and not any(v.lower() in answer for v in others)
    return {"reward": 0.8 * correct + 0.2 * looked_up, "success": float(correct),
            "looked_up": float(looked_up), "tool_calls": float(len(calls))}


async def episode(graph: Any, q: Question, worked_examples: bool = True) -> Trajectory:
    parts: dict[str, float] = {}

    def reward(state: dict[str, Any]) -> float:
        parts.update(score(state["messages"], q))
        return parts["reward"]

    recorder = TrajectoryRecorder(reward=reward)  # the one line that makes the agent trainable
    await graph.ainvoke({"messages": prompt(q, worked_examples)},
                        config={"callbacks": [recorder]})
    traj = await recorder.afinish()
    traj.metrics.update(success=bool(parts["success"]), tool_calls=int(parts["tool_calls"]))
    traj.metadata.update(country=q.country, field=q.field)
    return traj


def table(rows: list[tuple[str, EvalStats]]) -> str:
    lines = [f"{'':10} {'success':>14} {'95% interval':>16} {'reward':>8} {'tool calls':>11}"]
    for label, r in rows:
        rate = r.rate("success")
        lo, hi = rate.ci
        lines.append(f"{label:10} {rate.k:>4}/{rate.n:<3} {100 * rate.value:5.1f}% "
                     f"{f'[{100 * lo:.0f}%, {100 * hi:.0f}%]':>16} {r.reward:8.2f} "
                     f"{r.means.get('tool_calls', 0.0):11.2f}")
    return "\n".join(lines)


def examples(model_dir: Path, step: int) -> list[dict[str, Any]]:
    """One held-out episode per question at `step`, as {"messages", "reward"}."""
    return [g.trajectories[0].model_dump(include={"messages", "reward"})
            for g in load_eval_groups(model_dir, step) if g.trajectories]


def _question(example: dict[str, Any]) -> str:
    return next(m["content"] for m in reversed(example["messages"]) if m["role"] == "user")


def show_episode(label: str, example: dict[str, Any]) -> str:
    out = [f"--- {label} (reward {example['reward']:.2f})"]
    msgs = example["messages"]
    question = max(i for i, m in enumerate(msgs) if m["role"] == "user")  # after the examples
    for m in msgs[question:]:
        text = (m.get("content") or "").strip().replace("\n", " ")
        calls = " ".join(f"{c['function']['name']}({c['function']['arguments']})"
                         for c in m.get("tool_calls") or [])
        out.append(f"  {m['role']:>9}: {(text[:150] + ' ' + calls).strip()}")
    return "\n".join(out)


async def run(path: str = ".art", steps: int = 4, groups_per_step: int = 6,
              rollouts_per_group: int = 4, learning_rate: float = 1e-3, eval_samples: int = 2,
              fresh: bool = False, seed: int = 0, oversample: float = DEFAULT_BUDGET,
              train_config: TrainConfig | None = None) -> dict[str, EvalStats]:
    """Evaluate, train `steps` more steps, evaluate again (`art_core.loop.train_loop`);
    returns the two evaluations. `train_config` (default: TrainConfig(learning_rate)) lets a
    benchmark try other losses (benchmarks/demo_variants.py)."""
    async with LocalBackend(path) as backend:
        model = TrainableModel(name="agent", project="demo")
        model_dir = Path(path) / model.project / "models" / model.name
        if fresh and model_dir.exists():
            shutil.rmtree(model_dir)
            print(f"--fresh: removed {model_dir}")
        t0 = time.perf_counter()
        await model.register(backend)
        print(f"registered {model.name} on {model.base_model} "
              f"({time.perf_counter() - t0:.0f} s: engine and gateway up)")
        graph = build_agent(init_chat_model(model, max_tokens=MAX_TOKENS,
                                            temperature=TEMPERATURE))
        held_out = questions(HELD_OUT_COUNTRIES)
        print(f"\nheld-out: {len(HELD_OUT_COUNTRIES)} countries never trained on, "
              f"{len(held_out)} questions x {eval_samples} episodes; {steps} steps of "
              f"{groups_per_step} x {rollouts_per_group} episodes")

        def step_line(result: TrainResult, groups: list[TrajectoryGroup]) -> str:
            m, won = result.metrics, [t.metrics["success"] for g in groups for t in g]
            # the reward of everything sampled: the trained groups alone lean towards 0.5
            reward = m.get("sampling_reward_mean", m["reward_mean"])
            return (f"step {result.step:>3}  sampled reward {reward:.2f}  trained success "
                    f"{sum(won)}/{len(won)}  loss {m['loss']:+.4f}  {m['seconds']:.1f} s train"
                    f"{sampling_text(m)}")

        loop = await train_loop(
            model, lambda q: episode(graph, q), questions(TRAIN_COUNTRIES), held_out, model_dir,
            steps=steps, groups_per_step=groups_per_step, rollouts_per_group=rollouts_per_group,
            eval_rollouts=eval_samples,
            train_config=train_config or TrainConfig(learning_rate=learning_rate),
            seed=seed, oversample=oversample, on_step=step_line)
        first, last = min(loop.evals), loop.after.step
        print()
        print(table([(f"step {first}", loop.evals[first]), (f"step {last}", loop.after)]))
        print()
        before, after = examples(model_dir, first), examples(model_dir, last)
        if before and after:
            after_by_question = {_question(e): e for e in after}
            # a question the base model got wrong, if there is one, and the same question after
            shown = next((e for e in before
                          if e["reward"] < 1 and _question(e) in after_by_question), before[0])
            print(show_episode(f"step {first}, held-out episode", shown))
            print(show_episode(f"step {last}, the same question",
                               after_by_question.get(_question(shown), after[0])))
        _plot(model_dir, loop.evals)
        print(f"checkpoints in {model_dir / 'checkpoints'}")
        print(f"browse the run: art view {path}")
    return {"before": loop.evals[first], "after": loop.after}


def _plot(model_dir: Path, evals: dict[int, EvalStats]) -> None:
    from art_core.observe.plot import PlotError, plot_curves

    history = {int(r["step"]): float(r["reward_mean"])
               for r in read_jsonl(model_dir / "history.jsonl") if "reward_mean" in r}
    # with dynamic sampling the trained groups lean towards 0.5: plot what was sampled
    history |= {int(r["step"]): float(r["sampling_reward_mean"])
                for r in read_jsonl(model_dir / "sampling.jsonl") if "sampling_reward_mean" in r}
    curves = {
        "held-out success rate": {"agent": sorted(
            (s, r.rate("success").value) for s, r in evals.items())},
        "train reward (sampled)": {"agent": sorted(history.items())},
    }
    bands = {"held-out success rate": {"agent": sorted(
        (s, *r.rate("success").ci) for s, r in evals.items())}}
    try:
        out = plot_curves(curves, model_dir / "reward.png", bands=bands,
                          title="art demo: a LangGraph agent on SmolLM2-135M learns to answer "
                                "with a tool")
        print(f"plot: {out}")
    except PlotError as e:
        print(f"no plot: {e}")


def _quiet() -> None:
    """What the user sees is the demo: no library progress bars or deprecation notes."""
    import warnings

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="art demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default=".art", help="run directory (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="steps to add (default: %(default)s)")
    p.add_argument("--groups-per-step", type=int, default=6,
                   help="training questions per step (default: %(default)s)")
    p.add_argument("--rollouts-per-group", type=int, default=4,
                   help="episodes per question (default: %(default)s)")
    p.add_argument("--learning-rate", type=float, default=1e-3,
                   help="high for a 135M model (default: %(default)s)")
    p.add_argument("--eval-samples", type=int, default=2,
                   help="episodes per held-out question (default: %(default)s)")
    p.add_argument("--oversample", type=float, default=DEFAULT_BUDGET,
                   help="dynamic sampling: questions drawn per step, at most, as a multiple of "
                        "--groups-per-step, while groups whose episodes all score alike are "
                        "replaced; 1 trains what the first draw gives (default: %(default)s)")
    p.add_argument("--fresh", action="store_true", help="start over: delete the demo's model")
    args = p.parse_args(argv if argv is not None else [])
    _quiet()
    for name, least in (("steps", 1), ("groups_per_step", 1), ("rollouts_per_group", 2),
                        ("eval_samples", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}")
    if args.oversample < 1:
        p.error("--oversample must be at least 1")
    if not 0 < args.learning_rate < 1:
        p.error("--learning-rate must be between 0 and 1")
    asyncio.run(run(args.path, args.steps, args.groups_per_step, args.rollouts_per_group,
                    args.learning_rate, args.eval_samples, args.fresh,
                    oversample=args.oversample))
    return 0
