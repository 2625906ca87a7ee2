"""The smallest real RL loop: teach the default model (SmolLM2-135M) to name Paris.

    .venv/bin/python examples/quickstart.py

On a 2-core CPU it takes about 1.5 minutes; the mean reward (max 1.5) went
0.56 0.72 0.78 1.19 1.38 1.31 1.47 1.31 over the 8 steps.

Rollouts go through `model.openai_client()` (the gateway records the exact sampled tokens),
the reward is plain Python, and each `model.train` call is one GRPO step on a LoRA adapter that
vLLM serves right after. Swap `LocalBackend` for `RemoteBackend(url, api_key)` to train on a
server started with `art serve`.
"""

from __future__ import annotations

import asyncio

import art_core as art

QUESTIONS = ["What is the capital of France?", "Which city has the Eiffel Tower?",
             "Where is the Louvre museum?", "Name the largest city in France."]


async def rollout(model: art.TrainableModel, question: str) -> art.Trajectory:
    traj = art.Trajectory(messages=[{"role": "user", "content": question}])
    response = await model.openai_client().chat.completions.create(
        model=model.name, messages=traj.messages, max_tokens=48, temperature=1.0)
    traj.add_completion(response)  # the assistant message + its exact sampled tokens
    text = response.choices[0].message.content or ""
    traj.reward = ("Paris" in text) + 0.5 * (len(text.split()) < 12)
    return traj


async def main() -> None:
    async with art.LocalBackend(".art") as backend:
        model = art.TrainableModel(name="paris", project="examples")
        await model.register(backend)
        for _ in range(8):
            groups = await art.gather_trajectory_groups(
                [rollout(model, q) for _ in range(4)] for q in QUESTIONS)
            # 1e-3 suits a 135M model; billion-parameter models want 1e-5 to 1e-4
            result = await model.train(groups, art.TrainConfig(learning_rate=1e-3))
            print(f"step {result.step}: mean reward {result.metrics['reward_mean']:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
