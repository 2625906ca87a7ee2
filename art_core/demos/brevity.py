"""`art demo`: a real RL run on the embedded default model (SmolLM2-135M-Instruct), on CPU.

The task: answer open questions in as few words as possible while still answering in a
finished sentence. The system prompt asks for brevity, which the base model mostly ignores
(about 1 reply in 6 ends within 48 tokens), so RL has something to teach. The reward is plain
user code (no judge), so the run is fast and the curve easy to read:

    reward = 1 - min(words, 40) / 40   for a finished sentence (ends in . ! ?) of >= 3 words
    reward = 0                         otherwise (empty, a lone word, cut off at the limit)

The sentence rule matters: with length alone, the model learns to emit one made-up word. The
reward still checks form, not truth, so expect answers like "A volcano is a volcano." by the
end (the demo prints one held-out answer from step 0 and from the last step): scoring content
is what an LLM judge is for (`ruler`).

Each step: `groups_per_step` questions x `rollouts_per_group` rollouts through the gateway,
GRPO on a LoRA, hot-swap into vLLM. The run directory keeps everything; running the demo again
continues from the last step (resumable). At the end it prints the reward curve and writes a
plot next to the checkpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from art_core import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_core.loop import train_loop
from art_core.model import TrainResult
from art_core.observe.plot import PlotError, plot_curves

QUESTIONS = [
    "Describe the ocean.", "Why is the sky blue?", "What is a computer?",
    "Tell me about dogs.", "How do plants grow?", "What is music?", "Explain gravity.",
    "What is the internet?", "Describe a city at night.", "Why do we sleep?",
    "What is friendship?", "How does rain form?", "What is a volcano?", "Tell me about the moon.",
    "What is a library?", "How do birds fly?", "What is electricity?", "Describe winter.",
    "What is a forest?", "Why do cats purr?",
]
SYSTEM = "You are a helpful assistant. Answer briefly."
MAX_TOKENS = 48


def brevity_reward(text: str) -> float:
    """Shorter is better, but only for a finished sentence of at least three words: a lone
    word, an empty reply or one cut off mid-thought scores 0, so the model cannot win by
    emitting one token."""
    words = len(text.split())
    if words < 3 or not text.rstrip().endswith((".", "!", "?")):
        return 0.0
    return 1.0 - min(words, 40) / 40


async def rollout(model: TrainableModel, question: str, temperature: float = 1.0) -> Trajectory:
    """The ART-style user contract: a plain async function from scenario to Trajectory."""
    traj = Trajectory(messages=[{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": question}],
                      metadata={"question": question})
    response = await model.openai_client().chat.completions.create(
        model=model.name, messages=traj.messages, max_tokens=MAX_TOKENS, temperature=temperature)
    traj.add_completion(response)
    choice = response.choices[0]
    traj.reward = brevity_reward(choice.message.content or "")
    traj.metrics["words"] = len((choice.message.content or "").split())
    return traj


async def run(path: str = ".art", steps: int = 8, groups_per_step: int = 4,
              rollouts_per_group: int = 6, learning_rate: float = 1e-3, seed: int = 0,
              eval_questions: int = 8, plot: bool = True) -> list[tuple[int, float]]:
    """Train for `steps` steps (continuing an earlier run), evaluating after each; returns
    [(step, eval reward)] of the whole run directory, earlier runs included."""
    train_qs, eval_qs = QUESTIONS[:-eval_questions], QUESTIONS[-eval_questions:]
    async with LocalBackend(path) as backend:
        t0 = time.perf_counter()
        model = TrainableModel(name="brevity", project="demo")
        await model.register(backend)
        print(f"registered {model.name} on {model.base_model} "
              f"({time.perf_counter() - t0:.0f} s, engine + gateway up)")
        md = backend._dir(model)

        def step_line(result: TrainResult, groups: list[TrajectoryGroup]) -> str:
            m = result.metrics
            return (f"step {result.step:>3}  train reward {m['reward_mean']:.3f}  loss "
                    f"{m['loss']:+.4f}  {m['seconds']:.1f} s train  "
                    f"{m['trained_tokens']:.0f} tokens")

        loop = await train_loop(
            model, lambda q: rollout(model, q), train_qs, eval_qs, md.path, steps=steps,
            groups_per_step=groups_per_step, rollouts_per_group=rollouts_per_group,
            eval_rollouts=2, train_config=TrainConfig(learning_rate=learning_rate), seed=seed,
            eval_every=1, on_step=step_line)
        await _show_before_after(model, eval_qs[0], loop.after.step)
        curve = [(s, e.reward) for s, e in loop.evals.items()]
        if plot:
            try:
                out = plot_curves({"eval reward (held-out questions)": {model.name: curve}},
                                  md.path / "reward.png",
                                  title="art demo: SmolLM2-135M learns to answer briefly")
                print(f"plot: {out}  (training metrics: art plot --path {path})")
            except PlotError as e:
                print(f"no plot: {e}")
        print(f"reward curve: {' '.join(f'{s}:{r:.2f}' for s, r in curve)}")
        print(f"checkpoints in {md.checkpoints}")
    return curve


async def _show_before_after(model: TrainableModel, question: str, step: int) -> None:
    """One held-out question, answered greedily by step 0 and by the latest step."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    print(f"\n{question}")
    for name in (f"{model.name}@0", f"{model.name}@{step}"):
        r = await model.openai_client().chat.completions.create(
            model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        text = (r.choices[0].message.content or "").strip()
        print(f"  {name:>12}: {text!r}  (reward {brevity_reward(text):.2f})")
    print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="art demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default=".art",
                   help="run directory; an existing run continues (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8,
                   help="training steps to add (default: %(default)s)")
    p.add_argument("--groups-per-step", type=int, default=4,
                   help="questions per step (default: %(default)s)")
    p.add_argument("--rollouts-per-group", type=int, default=6,
                   help="answers sampled per question (default: %(default)s)")
    p.add_argument("--learning-rate", type=float, default=1e-3,
                   help="high for a 135M model: it learns in a few CPU steps, see TrainConfig "
                   "(default: %(default)s)")
    args = p.parse_args(argv if argv is not None else [])
    for name, least in (("steps", 1), ("groups_per_step", 1), ("rollouts_per_group", 2)):
        if getattr(args, name) < least:  # one rollout per group has no group-relative signal
            p.error(f"--{name.replace('_', '-')} must be at least {least}")
    if not 0 < args.learning_rate < 1:
        p.error("--learning-rate must be between 0 and 1")
    asyncio.run(run(args.path, args.steps, args.groups_per_step, args.rollouts_per_group,
                    args.learning_rate))
    return 0
