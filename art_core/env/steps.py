"""Step environments, trained unchanged: the reset/step shape of OpenEnv, gymnasium, TextArena
and reasoning-gym, played by the model through our gateway.

The protocol `step_rollout` plays (a text environment of your own implements it, sync or
async): `reset(**row)` returns the first observation (text); `step(reply)` takes the model's
reply text and returns a `Step(observation, reward, done)` (or that tuple); `close()`, when there
is one, is called at the end, and a number it returns is added to the last turn's reward
(TextArena gives its rewards there). The libraries' own shapes go through a shim, each a few
lines of duck typing (no import of the library): `GymnasiumText` (the 5-tuple; `terminated or
truncated` ends the episode), `TextArenaText` (`step -> (done, info)`, rewards from `close()`,
its observation is the whole game so far: only what is new is sent), `OpenEnvText` (a sync or
async client, `GenericEnvClient` included: `StepResult(observation, reward, done)`, the reply
made into an action by `action=`), `ReasoningGymText` (one question, one answer scored by the
dataset's own `score_answer`).

One rollout, `step_rollout(model, make_env, row)`:

1. `env = make_env()` (one environment per rollout); the messages are the system prompt, if
   given, then `reset(**row)`'s observation as the first user message.
2. Up to `max_turns` replies through our gateway (token in, token out: the episode trains as
   one sequence). Each reply's text goes to `step`; the reward `step` returns is that turn's
   own reward (`SampledTurn.reward`, what per-turn credit uses); unless the episode is done,
   the observation is the next user message.
3. The trajectory's reward is the sum of its turns' rewards: the episode's return.
4. Every call into the environment runs under `step_timeout_s`, a sync one in a thread (a slow
   environment does not stall the other rollouts; a hung thread is left behind, not waited
   for). A call that raises or hangs ends this rollout with `EnvFailed` naming the call and the
   turn: `gather_trajectory_groups` counts it as a failed rollout (`max_exceptions`), and the
   step trains on the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from art_core.env.tools import EnvError
from art_core.trajectory import Trajectory


@dataclass(frozen=True)
class Step:
    """What `step(reply)` returns: the next observation, this turn's reward, whether it ended."""

    observation: str | None = None
    reward: float = 0.0
    done: bool = False


class EnvFailed(RuntimeError):
    """A call into the environment raised or did not answer in time: this rollout ends."""


async def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a sync or async function without blocking the event loop."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def _env_call(what: str, turn: int, timeout: float, fn: Callable[..., Any], *args: Any,
                    **kwargs: Any) -> Any:
    try:
        return await asyncio.wait_for(_run(fn, *args, **kwargs), timeout)
    except TimeoutError:
        raise EnvFailed(f"the environment's {what} at turn {turn} did not answer within "
                        f"{timeout:g} s") from None
    except Exception as e:
        raise EnvFailed(f"the environment's {what} at turn {turn} failed: "
                        f"{type(e).__name__}: {e}") from e


def observation_text(observation: Any) -> str:
    """An observation as the text of a user message: a string as it is, a pydantic model or a
    mapping as JSON (without `reward`, `done` and `metadata`), anything else by `str`."""
    if isinstance(observation, str):
        return observation
    if hasattr(observation, "model_dump"):
        observation = observation.model_dump()
    if isinstance(observation, Mapping):
        shown = {k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")}
        return json.dumps(shown, default=str)
    return str(observation)


def as_step(value: Any, turn: int) -> Step:
    """`step`'s answer as a `Step`: a `Step`, or `(observation, reward, done)`."""
    if isinstance(value, Step):
        return value
    if isinstance(value, tuple) and len(value) == 3:
        observation, reward, done = value
        return Step(None if observation is None else observation_text(observation),
                    float(reward or 0.0), bool(done))
    raise EnvFailed(f"the environment's step at turn {turn} returned {type(value).__name__}; "
                    "expected a Step or (observation, reward, done): wrap a library's "
                    "environment in its shim (GymnasiumText, TextArenaText, OpenEnvText, "
                    "ReasoningGymText)")


async def step_rollout(model: Any, environment: Callable[[], Any],
                       row: Mapping[str, Any] | None = None, *, max_turns: int = 10,
                       max_tokens: int = 128, temperature: float = 1.0,
                       system_prompt: str | None = None, step_timeout_s: float = 60.0
                       ) -> Trajectory:
    """One episode of a step environment (the module docstring); a Trajectory with a reward
    per turn, ready for `gather_trajectory_groups` and `model.train`. `environment` makes one
    environment per rollout (a class or a function); `row` goes to its `reset`."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    env = environment()
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise EnvError(f"{type(env).__name__} has no {' or '.join(missing)} method: a step "
                       "environment has reset and step (a library's environment goes through "
                       "its shim: GymnasiumText, TextArenaText, OpenEnvText, ReasoningGymText)")
    traj = Trajectory(messages=[{"role": "system", "content": system_prompt}]
                      if system_prompt else [])
    traj.metadata["environment"] = type(env).__name__
    m = traj.metrics
    m.update(turns=0, done=False, ran_out_of_turns=False)
    ended = False
    try:
        first = await _env_call("reset", 0, step_timeout_s, env.reset, **dict(row or {}))
        traj.messages.append({"role": "user", "content": observation_text(first)})
        client = model.openai_client()
        while m["turns"] < max_turns:
            response = await client.chat.completions.create(
                model=model.name, messages=traj.messages, max_tokens=max_tokens,
                temperature=temperature)
            reply = traj.add_completion(response).get("content") or ""
            turn = m["turns"]
            m["turns"] += 1
            step = as_step(await _env_call("step", turn, step_timeout_s, env.step, reply), turn)
            traj.set_turn_reward(turn, step.reward)
            if step.done:
                m["done"] = True
                break
            traj.messages.append({"role": "user", "content": step.observation or ""})
        else:
            m["ran_out_of_turns"] = True
        ended = True
    finally:
        close = getattr(env, "close", None)
        if callable(close) and not ended:  # the rollout failed: close quietly, keep its error
            with contextlib.suppress(Exception):  # the first error is the one to report
                await asyncio.wait_for(_run(close), step_timeout_s)
    if callable(close):
        final = await _env_call("close", m["turns"], step_timeout_s, close)
        if isinstance(final, int | float) and not isinstance(final, bool) and final:
            last = len(traj.turns) - 1
            traj.set_turn_reward(last, (traj.turns[last].reward or 0.0) + float(final))
    traj.reward = sum(r or 0.0 for r in traj.turn_rewards)
    return traj


class GymnasiumText:
    """A gymnasium environment with text observations and actions: `reset` -> (obs, info),
    `step` -> (obs, reward, terminated, truncated, info)."""

    def __init__(self, env: Any, text: Callable[[Any], str] = observation_text) -> None:
        self.env, self.text = env, text

    def reset(self, **kwargs: Any) -> str:
        observation, _info = self.env.reset(**kwargs)
        return self.text(observation)

    def step(self, reply: str) -> Step:
        observation, reward, terminated, truncated, _info = self.env.step(reply)
        return Step(self.text(observation), float(reward), bool(terminated or truncated))

    def close(self) -> None:
        self.env.close()


class TextArenaText:
    """A TextArena game played by one player: `step` -> (done, info), rewards from `close()`
    as ({player: reward}, info); the observation is the game so far, so only what is new is
    sent as the next message."""

    def __init__(self, env: Any, player_id: int = 0) -> None:
        self.env, self.player_id, self.seen = env, player_id, ""

    def _new_text(self) -> str:
        _player, observation = self.env.get_observation()
        text = observation_text(observation)
        new = text[len(self.seen):] if text.startswith(self.seen) else text
        self.seen = text
        return new.strip()

    def reset(self, **kwargs: Any) -> str:
        self.env.reset(**{"num_players": 1, **kwargs})
        self.seen = ""
        return self._new_text()

    def step(self, reply: str) -> Step:
        done, _info = self.env.step(reply)
        return Step(None if done else self._new_text(), 0.0, bool(done))

    def close(self) -> float:
        rewards, _info = self.env.close()
        return float((rewards or {}).get(self.player_id, 0.0))


class OpenEnvText:
    """An OpenEnv client, sync or async (`GenericEnvClient` included): `reset()` and
    `step(action)` return `StepResult(observation, reward, done)`. `action` makes the reply an
    action (default: `{"message": reply}`, a dict for `GenericEnvClient`); `text` makes an
    observation the next user message."""

    def __init__(self, client: Any, action: Callable[[str], Any] | None = None,
                 text: Callable[[Any], str] = observation_text) -> None:
        self.client, self.text = client, text
        self.action = action or (lambda reply: {"message": reply})

    async def reset(self, **kwargs: Any) -> str:
        return self.text((await _run(self.client.reset, **kwargs)).observation)

    async def step(self, reply: str) -> Step:
        result = await _run(self.client.step, self.action(reply))
        return Step(self.text(result.observation), float(result.reward or 0.0),
                    bool(result.done))

    async def close(self) -> None:
        if callable(getattr(self.client, "close", None)):
            await _run(self.client.close)


class ReasoningGymText:
    """One reasoning-gym question per episode: `reset(index=i)` asks `dataset[i]`, the reply is
    the answer (`extract` may pull it out of the reply), scored by `dataset.score_answer`."""

    def __init__(self, dataset: Any, extract: Callable[[str], str] | None = None) -> None:
        self.dataset, self.extract, self.entry = dataset, extract, None

    def reset(self, index: int = 0) -> str:
        self.entry = self.dataset[index]
        return str(self.entry["question"])

    def step(self, reply: str) -> Step:
        answer = self.extract(reply) if self.extract else reply.strip()
        score = self.dataset.score_answer(answer=answer, entry=self.entry)
        return Step(None, float(score), True)
