"""One BFCL multi-turn episode through our gateway, as BFCL's `inference_multi_turn_FC` runs it,
recorded as a trainable trajectory and scored by BFCL's multi-turn checker (`multi_turn.py` in
the worker).

Per user turn: its messages are appended; the model is asked with the entry's tools
(`tool_choice` left to it, as BFCL's OpenAI handler does); each step's tool calls are decoded
and run by BFCL on this episode's own API instances and their results come back as tool
messages; a step without calls that decode ends the turn; a turn of more than BFCL's step limit
(20) ends the episode, force-terminated. A conversation that outgrows the engine's context ends
the episode the same way (`context_full`).

Rewards: `reward` = turns passed in a row from the first / turns (the official verdict is
`metrics["passed"]`); per turn (for `TrainConfig(advantage="turn")`), the last assistant turn
of each user turn that passed gets 1 / turns, so the per-turn rewards sum to the episode's.

`ground_truth_episode` is the same conversation as the ground truth would hold it (its calls
one per step, run by BFCL on the episode's own instances, and a short reply without a call
that ends each user turn): supervised data for a warm start, since SmolLM2-135M never makes a
call that decodes here and RL from its own attempts has no signal (docs/bfcl.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

from art_bfcl.checker import BfclWorker, Calls, MultiTurnItem, ground_truth_steps, step_calls

MAX_STEPS = 20  # BFCL's MAXIMUM_STEP_LIMIT (bfcl_eval.constants.default_prompts)


async def multi_turn_episode(client: Any, model: str, item: MultiTurnItem, worker: BfclWorker,
                             *, temperature: float = 0.0, max_tokens: int = 256) -> Any:
    """Run `item` with `model` and return its Trajectory, reward and metrics set."""
    import openai

    from art_core import Trajectory

    traj = Trajectory(messages=[], tools=item.tools)
    session = f"{item.id}-{uuid.uuid4().hex[:12]}"  # BFCL keys instances by this name
    turns: list[list[Calls]] = []
    ends: list[int] = []  # per user turn answered: the index of its last sampled turn
    stop = ""
    try:
        for user_turn in item.turns:
            traj.messages.extend(dict(m) for m in user_turn)
            steps: list[Calls] = []
            while True:
                try:
                    response = await client.chat.completions.create(
                        model=model, messages=traj.messages, tools=item.tools,
                        temperature=temperature, max_tokens=max_tokens)
                except openai.BadRequestError as e:
                    if "context" not in str(e).lower() and "too long" not in str(e).lower():
                        raise
                    stop = "context_full"
                    break
                message = traj.add_completion(response)
                calls = step_calls(message)
                steps.append(calls)
                ran = await asyncio.to_thread(worker.execute, item, session, calls)
                if ran is None:
                    break
                for call, result in zip(message["tool_calls"], ran[1], strict=False):
                    traj.messages.append({"role": "tool", "tool_call_id": call["id"],
                                          "content": result})
                if len(steps) > MAX_STEPS:
                    stop = "force_quit"
                    break
            if stop:
                break
            turns.append(steps)
            ends.append(len(traj.turns) - 1)
    finally:
        await asyncio.to_thread(worker.end_session, session)
    verdict = await asyncio.to_thread(worker.check_turns, item, turns)
    n = verdict.n_turns
    traj.reward = verdict.turns_passed / n
    for i in range(min(verdict.turns_passed, len(ends))):
        traj.set_turn_reward(ends[i], 1.0 / n)
    traj.metrics.update(passed=float(verdict.valid), turns_passed=float(verdict.turns_passed),
                        turns=float(n), model_calls=float(len(traj.turns)),
                        context_full=float(stop == "context_full"),
                        force_quit=float(stop == "force_quit"))
    traj.metadata.update(id=item.id, error_type=verdict.error_type or "")
    return traj


def ground_truth_episode(item: MultiTurnItem, worker: BfclWorker, *,
                         reply: str = "Done.") -> Any:
    """The episode the ground truth makes of `item`, as a Trajectory (reward 1) for SFT: per
    user turn its messages, each ground-truth call as an assistant step followed by BFCL's
    result of it, then `reply` (a message without a call ends the turn, as in an episode)."""
    from art_core import Trajectory

    traj = Trajectory(messages=[], tools=item.tools, reward=1.0)
    session = f"{item.id}-truth-{uuid.uuid4().hex[:12]}"
    try:
        for t, (user_turn, steps) in enumerate(zip(item.turns, ground_truth_steps(item),
                                                   strict=True)):
            traj.messages.extend(dict(m) for m in user_turn)
            for k, calls in enumerate(steps):
                ran = worker.execute(item, session, calls)
                if ran is None:
                    raise ValueError(f"{item.id}: ground-truth call {calls} of turn {t} does not "
                                     "decode")
                ids = [f"call_{t}_{k}_{j}" for j in range(len(calls))]
                traj.messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": i, "type": "function", "function": {"name": name, "arguments": args}}
                    for i, call in zip(ids, calls, strict=True) for name, args in call.items()]})
                traj.messages.extend({"role": "tool", "tool_call_id": i, "content": result}
                                     for i, result in zip(ids, ran[1], strict=True))
            traj.messages.append({"role": "assistant", "content": reply})
    finally:
        worker.end_session(session)
    traj.metadata.update(id=item.id)
    return traj


def multi_turn_report(trajs: list[Any]) -> str:
    """A table of scored episodes: the official accuracy (every turn passes) and the per-turn
    pass rate (turns passed in a row from the first, over all turns), each with its 95% Wilson
    interval (one entry's turns are not independent: the per-turn interval is narrower than it
    should be); the mean model calls per entry and how many outgrew the context or the step
    limit."""
    from art_core.observe.base import wilson

    n = len(trajs)
    passed = sum(int(t.metrics["passed"]) for t in trajs)
    turns = sum(int(t.metrics["turns"]) for t in trajs)
    turns_ok = sum(int(t.metrics["turns_passed"]) for t in trajs)
    rows = [("official (all turns)", passed, n), ("per turn (in a row)", turns_ok, turns)]
    lines = [f"{'metric':<22} {'passed':>7} {'of':>5} {'rate':>7} {'95% interval':>14}"]
    for label, k, total in rows:
        lo, hi = wilson(k, total)
        lines.append(f"{label:<22} {k:>7} {total:>5} {100 * k / max(total, 1):>6.1f}% "
                     f"{f'[{100 * lo:.1f}%, {100 * hi:.1f}%]':>14}")
    calls = sum(t.metrics["model_calls"] for t in trajs) / max(n, 1)
    full = sum(int(t.metrics["context_full"]) for t in trajs)
    quit_ = sum(int(t.metrics["force_quit"]) for t in trajs)
    lines.append(f"{calls:.1f} model calls per entry; context full {full}, step limit {quit_} "
                 f"of {n} entries")
    return "\n".join(lines)


def held_out_ids(items: list[MultiTurnItem], n: int = 100, seed: int = 0) -> list[str]:
    """The `n` held-out entries: ordered by a hash of the seed and the id (not the data's
    order), the first n."""
    ids = sorted((i.id for i in items),
                 key=lambda i: hashlib.sha256(f"{seed}:{i}".encode()).hexdigest())
    if n >= len(ids):
        raise ValueError(f"{len(ids)} entries: cannot hold out {n} and train on the rest")
    return ids[:n]
