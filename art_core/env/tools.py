"""Tool environments written for TRL's `environment_factory`, trained here unchanged.

The contract (TRL 1.16, `GRPOTrainer(environment_factory=...)`), which `tool_rollout` follows:
one instance per rollout; `reset(**row)` may return a string, appended to the last user
message; every public method but `reset` and `get_reward` is a tool, sync or async, whose
schema is what `transformers.utils.get_json_schema` makes of its type hints and Google-style
docstring (the same function TRL uses: no parser of our own); `get_reward()` (sync or async),
when defined, is the reward; a dict of classes lets each row pick one by its `environment`
field (that field is not passed to `reset`).

The algorithm of one rollout, `tool_rollout(model, Env, row)`:

1. Pick and build the environment; refuse, naming it, a class with no public method, a method
   whose schema cannot be made (a missing type hint or argument description), and a rollout
   with no reward source (no `get_reward`, no `reward=`), before anything runs.
2. Messages: the row's `prompt` (a list of chat messages, or a string as one user message),
   then `reset(**row)`'s observation appended to the last user message.
3. Up to `max_turns` model calls through our gateway (token in, token out: the conversation
   trains as one sequence, each assistant turn with its exact sampled tokens). Each tool call
   goes to its method with its JSON arguments (a sync method in a thread, so a slow one does
   not stall other rollouts); what it returns comes back as the tool message (`str(result)`,
   as TRL does); a method that raises, an unknown tool or arguments that are not JSON come
   back as `{"error": "..."}` and are counted (`tool_failures`), and the rollout goes on. A
   reply without a tool call ends the rollout.
4. reward = `get_reward()`, else `reward(env, trajectory)` (sync or async).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from art_core.trajectory import Trajectory

Factory = Callable[[], Any]
"""A class (or any callable) that makes one environment instance per rollout."""
Reward = Callable[[Any, Trajectory], float | Awaitable[float]]
"""`reward(env, trajectory)`: the reward when the environment has no `get_reward`."""

RESERVED = ("reset", "get_reward")


class EnvError(ValueError):
    """An environment that cannot be run as given (the message names what is wrong)."""


def tool_methods(env: Any) -> dict[str, Callable[..., Any]]:
    """The environment's tools: its public methods but `reset` and `get_reward`, bound, by
    name (listed on the class, as TRL does: listing the instance would evaluate properties)."""
    return {name: getattr(env, name)
            for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")}


def tool_schemas(env: Any) -> list[dict[str, Any]]:
    """OpenAI tool schemas of the environment's tools, exactly as
    `transformers.utils.get_json_schema` makes them; `EnvError` names a method it cannot read."""
    from transformers.utils import get_json_schema

    methods = tool_methods(env)
    name = type(env).__name__
    if not methods:
        raise EnvError(f"{name} has no public method to offer as a tool (every public method "
                       "but reset and get_reward is one)")
    schemas = []
    for method_name, method in methods.items():
        try:
            schemas.append(get_json_schema(method))
        except Exception as e:  # transformers' TypeHintParsingException / DocstringParsing...
            raise EnvError(f"{name}.{method_name} cannot be offered as a tool: {e} (each "
                           "argument needs a type hint and an 'Args:' line in the docstring)"
                           ) from None
    return schemas


def pick(environment: Factory | Mapping[str, Factory], row: Mapping[str, Any]
         ) -> tuple[Factory, dict[str, Any]]:
    """The factory for `row` and the keyword arguments of its `reset`."""
    if isinstance(environment, Mapping):
        key = row.get("environment")
        if key not in environment:
            raise EnvError(f"row's environment {key!r} is not one of {sorted(environment)}")
        return environment[key], {k: v for k, v in row.items() if k != "environment"}
    return environment, dict(row)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _first_messages(row: Mapping[str, Any], system_prompt: str | None) -> list[dict[str, Any]]:
    prompt = row.get("prompt") or []
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
        [dict(m) for m in prompt]
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _observe(messages: list[dict[str, Any]], observation: Any) -> None:
    """`reset`'s observation, appended to the last user message (a new one if there is none)."""
    if observation is None:
        return
    text = observation if isinstance(observation, str) else str(observation)
    if messages and messages[-1].get("role") == "user" and \
            isinstance(messages[-1].get("content"), str):
        messages[-1] = {**messages[-1], "content": messages[-1]["content"] + text}
    else:
        messages.append({"role": "user", "content": text})


async def _call(methods: dict[str, Callable[..., Any]], call: dict[str, Any]) -> tuple[str, bool]:
    """Run one tool call; (the tool message's content, whether it failed)."""
    fn = call.get("function") or {}
    name = fn.get("name")
    try:
        if name not in methods:
            raise EnvError(f"tool {name!r} not found; the tools are {sorted(methods)}")
        arguments = json.loads(fn.get("arguments") or "{}")
        if not isinstance(arguments, dict):
            raise EnvError(f"arguments must be a JSON object, got {arguments!r}")
        method = methods[name]
        if inspect.iscoroutinefunction(method):
            result = await method(**arguments)
        else:  # in a thread: a slow environment must not stall the other rollouts
            result = await asyncio.to_thread(method, **arguments)
        return str(result), False
    except Exception as e:
        return json.dumps({"error": f"{type(e).__name__}: {e}"}), True


async def tool_rollout(model: Any, environment: Factory | Mapping[str, Factory],
                       row: Mapping[str, Any] | None = None, *, reward: Reward | None = None,
                       max_turns: int = 10, tool_choice: str | dict[str, Any] = "auto",
                       max_tokens: int = 256, temperature: float = 1.0,
                       system_prompt: str | None = None) -> Trajectory:
    """One rollout of a TRL-style tool environment (the module docstring); a Trajectory
    ready for `gather_trajectory_groups` and `model.train`. `model` is a `TrainableModel` (or
    any `Model` whose endpoint is our gateway); `tool_choice="required"` forces a call every
    turn (the gateway then holds it to the tools' schemas)."""
    row = dict(row or {})
    factory, reset_kwargs = pick(environment, row)
    env = factory()
    schemas = tool_schemas(env)
    if not hasattr(env, "reset"):
        raise EnvError(f"{type(env).__name__} has no reset method")
    if not callable(getattr(env, "get_reward", None)) and reward is None:
        raise EnvError(f"{type(env).__name__} has no get_reward method and no reward= was "
                       "given: the rollout would have no reward")
    methods = tool_methods(env)
    # OpenAI's tool format has no "return" entry (get_json_schema adds one for the template)
    tools = [{**s, "function": {k: v for k, v in s["function"].items() if k != "return"}}
             for s in schemas]
    traj = Trajectory(messages=_first_messages(row, system_prompt), tools=tools)
    _observe(traj.messages, await _maybe_await(env.reset(**reset_kwargs)))
    traj.metadata["environment"] = type(env).__name__
    m = traj.metrics
    m.update(turns=0, tool_calls=0, tool_failures=0, ran_out_of_turns=False)
    client = model.openai_client()
    while m["turns"] < max_turns:
        response = await client.chat.completions.create(
            model=model.name, messages=traj.messages, tools=tools, tool_choice=tool_choice,
            max_tokens=max_tokens, temperature=temperature)
        m["turns"] += 1
        message = traj.add_completion(response)
        calls = message.get("tool_calls") or []
        if not calls:
            break
        for call in calls:
            content, failed = await _call(methods, call)
            m["tool_calls"] += 1
            m["tool_failures"] += int(failed)
            traj.messages.append({"role": "tool", "tool_call_id": call["id"],
                                  "content": content})
    else:
        m["ran_out_of_turns"] = True
    if callable(getattr(env, "get_reward", None)):
        value = await _maybe_await(env.get_reward())
    else:
        assert reward is not None
        value = await _maybe_await(reward(env, traj))
    traj.reward = float(value)
    return traj
