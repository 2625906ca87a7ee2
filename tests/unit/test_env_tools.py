"""TRL-style tool environments (art_core/env/tools.py) without an engine: the tools and their
schemas are TRL's (`transformers.utils.get_json_schema` of the public methods), bad classes
and rows are refused by name before anything runs, and each call reaches its method (sync or
async), errors come back as a tool error. The rollout through the real engine:
tests/engine/test_env_tools.py."""

from __future__ import annotations

import json

import pytest
from transformers.utils import get_json_schema

from art_core.env import EnvError, tool_methods, tool_rollout, tool_schemas
from art_core.env.tools import _call, pick
from tests.support.envs import CounterEnv, NoReward, NoTools, Untyped


def test_the_tools_are_the_public_methods_with_transformers_schemas():
    env = CounterEnv()
    assert sorted(tool_methods(env)) == ["add", "explode", "shout"]
    assert tool_schemas(env) == [get_json_schema(env.add), get_json_schema(env.explode),
                                 get_json_schema(env.shout)]


@pytest.mark.parametrize(("env", "message"), [
    (NoTools(), "NoTools has no public method to offer as a tool"),
    (Untyped(), "Untyped.move cannot be offered as a tool: .*missing a type hint"),
])
def test_a_class_that_cannot_offer_tools_is_refused_by_name(env, message):
    with pytest.raises(EnvError, match=message):
        tool_schemas(env)


async def test_a_rollout_without_a_reward_source_is_refused_before_it_runs():
    class Model:  # never reached: the refusal comes first
        name = "m"

        def openai_client(self):
            raise AssertionError("no request may be sent")

    with pytest.raises(EnvError, match="NoReward has no get_reward method and no reward="):
        await tool_rollout(Model(), NoReward, {"prompt": "hi"})


@pytest.mark.parametrize(("row", "chosen", "kwargs"), [
    ({"environment": "count", "start": 3}, CounterEnv, {"start": 3}),
    ({"environment": "none"}, NoTools, {}),
])
def test_a_dict_of_classes_picks_by_the_rows_environment(row, chosen, kwargs):
    factory, reset_kwargs = pick({"count": CounterEnv, "none": NoTools}, row)
    assert factory is chosen and reset_kwargs == kwargs  # 'environment' is not passed on
    with pytest.raises(EnvError, match=r"row's environment 'other' is not one of \['count'"):
        pick({"count": CounterEnv}, {"environment": "other"})


@pytest.mark.parametrize(("name", "arguments", "content", "failed"), [
    ("add", {"amount": 4}, "total 9", False),
    ("shout", {"text": "hi"}, "HI", False),  # an async method
    ("explode", {"reason": "test"}, '{"error": "RuntimeError: exploded: test"}', True),
    ("missing", {}, None, True),
    ("add", {"amount": 1, "extra": 2}, None, True),  # a wrong argument: the method raises
])
async def test_each_call_reaches_its_method_and_errors_come_back(name, arguments, content,
                                                                 failed):
    env = CounterEnv()
    env.reset(start=5)
    call = {"id": "c1", "function": {"name": name, "arguments": json.dumps(arguments)}}
    got, did_fail = await _call(tool_methods(env), call)
    assert did_fail == failed
    if content is not None:
        assert got == content
    else:
        assert "error" in json.loads(got)
    if name in ("add", "shout", "explode") and "extra" not in arguments:
        assert env.calls == [(name, arguments)]


async def test_arguments_that_are_not_json_come_back_as_an_error():
    env = CounterEnv()
    env.reset()
    got, failed = await _call(tool_methods(env), {"function": {"name": "add",
                                                               "arguments": "{amount: 1"}})
    assert failed and "JSONDecodeError" in got and env.calls == []
