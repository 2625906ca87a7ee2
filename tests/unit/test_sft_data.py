"""SFT data: chat-format JSONL read into trajectories, errors that name the file, line and
problem, and the assistant mask of a rendered conversation (on SmolLM2's tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from art_core.sft import SFTDataError, as_trajectories, load_chat_jsonl
from art_core.sft.render import assistant_mask_tokens
from art_core.trajectory import Trajectory, TrajectoryGroup

TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
TOOL_EXAMPLE = {
    "messages": [
        {"role": "system", "content": "You answer about the weather."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 7 C"},
        {"role": "assistant", "content": "Rainy and 7 C in Oslo."},
    ],
    "tools": TOOLS,
    "parallel_tool_calls": False,
}
SIMPLE = {"messages": [{"role": "user", "content": "Hi"},
                       {"role": "assistant", "content": "Hello!"}]}


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _with(messages: list[dict[str, Any]], **extra: Any) -> str:
    return json.dumps({"messages": messages, **extra})


USER = {"role": "user", "content": "Hi"}
ASSISTANT = {"role": "assistant", "content": "Hello!"}

BAD_LINES = [  # (line, what the error must say)
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object, got a list"),
    ('{"tools": []}', 'missing "messages"'),
    ('{"messages": []}', '"messages" must be a non-empty list'),
    (_with(["hi", ASSISTANT]), "messages[0] is a string, not an object"),
    (_with([{"role": "bot", "content": "x"}, ASSISTANT]), "role 'bot'"),
    (_with([{"role": "user", "content": 3}, ASSISTANT]), "messages[0].content must be"),
    (_with([USER, {"role": "assistant"}]), "messages[1].content must be"),
    (_with([USER, {"role": "assistant", "content": [{"text": "x"}]}]),
     'messages[1].content[0] must be an object with a "type"'),
    (_with([USER, {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]),
     "messages[1].tool_calls[0] has no function.name"),
    (_with([USER, {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages[1].tool_calls[0].function.arguments must be a JSON object"),
    (_with([USER, {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}]}]),
     "function.arguments must be a JSON object"),
    (_with([USER, {"role": "assistant", "content": None,
                   "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]),
     "messages[1].tool_calls[0] has no id"),
    (_with([USER, {"role": "tool", "tool_call_id": "nope", "content": "x"}, ASSISTANT]),
     "messages[1] is a tool message with tool_call_id='nope'"),
    (_with([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, ASSISTANT]),
     "messages[1] makes tool call 'call_1', which no later tool message answers"),
    (_with([USER]), "no assistant message to train on"),
    (_with([USER, {**ASSISTANT, "weight": 0}]), "no assistant message to train on"),
    (_with([USER, {**ASSISTANT, "weight": 2}]), "messages[1].weight is 2"),
    (_with([{**USER, "weight": 1}, ASSISTANT]), "messages[0] has a weight"),
    (_with([USER, ASSISTANT], tools={"name": "f"}), '"tools" must be a list'),
    (_with([USER, ASSISTANT], tools=[{"type": "function", "function": {}}]), "tools[0] must be"),
    (_with([USER, ASSISTANT], tools=[{"name": "f"}]), "tools[0] must be"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_a_bad_line_names_file_line_and_problem(tmp_path, line, problem):
    # a good line and a blank line first: the bad one is line 3 of the file
    path = _write(tmp_path / "train.jsonl", [json.dumps(SIMPLE), "", line])
    with pytest.raises(SFTDataError) as err:
        load_chat_jsonl(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert problem in str(err.value)


def test_a_missing_file_names_its_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_chat_jsonl(tmp_path / "nope.jsonl")


def test_a_good_file_round_trips(tmp_path):
    weighted = {"messages": [USER, {**ASSISTANT, "weight": 0}, USER,
                             {"role": "assistant", "content": "Again!", "weight": 1}]}
    path = _write(tmp_path / "train.jsonl",
                  [json.dumps(TOOL_EXAMPLE), "   ", json.dumps(weighted)])
    first, second = load_chat_jsonl(str(path))
    assert first.messages == TOOL_EXAMPLE["messages"]  # tool_calls, tool_call_id kept as given
    assert first.tools == TOOLS
    assert first.reward == 0.0 and not first.trainable  # no sampled turns: rendered to train
    assert first.metadata == {"source": f"{path}:1"}
    assert second.messages == weighted["messages"]  # weights kept for the renderer
    assert second.tools is None and second.metadata == {"source": f"{path}:3"}


def test_as_trajectories_takes_paths_objects_and_dicts(tmp_path):
    path = _write(tmp_path / "train.jsonl", [json.dumps(SIMPLE)])
    assert [t.messages for t in as_trajectories(path)] == [SIMPLE["messages"]]
    traj = Trajectory(messages=SIMPLE["messages"])
    group = TrajectoryGroup(trajectories=[traj, traj])
    mixed = as_trajectories([traj, group, TOOL_EXAMPLE])
    assert len(mixed) == 4 and mixed[3].tools == TOOLS
    assert mixed[3].metadata == {"source": "<data>:3"}


@pytest.mark.parametrize(("data", "problem"), [
    ([], "no examples"),
    ([SIMPLE, {"messages": [USER]}], "<data>:2: no assistant message"),
    ([SIMPLE, "hello"], "<data>:2: a str"),
])
def test_as_trajectories_errors(data, problem):
    with pytest.raises(SFTDataError, match=problem):
        as_trajectories(data)


def test_an_empty_file_has_no_examples(tmp_path):
    with pytest.raises(SFTDataError, match="no examples"):
        as_trajectories(_write(tmp_path / "empty.jsonl", [""]))


# ---- the assistant mask ---------------------------------------------------------------------

def _trained_text(tokenizer: Any, tokens: list[int], mask: list[int]) -> list[str]:
    """The decoded runs of consecutive masked tokens."""
    runs: list[list[int]] = []
    for k, (tok, m) in enumerate(zip(tokens, mask, strict=True)):
        if m:
            if k == 0 or not mask[k - 1]:
                runs.append([])
            runs[-1].append(tok)
    return [tokenizer.decode(r) for r in runs]


MASK_MESSAGES = [*TOOL_EXAMPLE["messages"],
                 {"role": "user", "content": "And tomorrow?"},
                 {"role": "assistant", "content": "Sunny.", "weight": 0},
                 {"role": "user", "content": "Thanks!"},
                 {"role": "assistant", "content": "You're welcome."}]
CALL_TEXT = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
END = "<|im_end|>\n"  # the template's end of turn, trained so the model learns to stop


@pytest.mark.parametrize(("turns", "expected"), [
    ("all", [CALL_TEXT + END, "Rainy and 7 C in Oslo." + END, "You're welcome." + END]),
    ("last", ["You're welcome." + END]),
])
def test_the_mask_covers_exactly_the_assistant_turns(smollm2_tokenizer, turns, expected):
    tokens, mask = assistant_mask_tokens(smollm2_tokenizer, MASK_MESSAGES, TOOLS, turns)
    assert len(tokens) == len(mask)
    assert _trained_text(smollm2_tokenizer, tokens, mask) == expected  # weight 0: context
    # the sequence is the whole conversation, weight-0 turn included as context
    whole = smollm2_tokenizer.apply_chat_template(MASK_MESSAGES, tools=TOOLS, tokenize=False)
    assert smollm2_tokenizer.decode(tokens) == whole


def test_a_template_that_rewrites_earlier_turns_is_named(smollm2_tokenizer):
    import copy

    tok = copy.deepcopy(smollm2_tokenizer)
    # like templates that drop past reasoning: an earlier assistant turn renders differently
    # once a later turn exists
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}(earlier){% else %}{{ m.content }}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [USER, ASSISTANT, USER, {"role": "assistant", "content": "Bye."}]
    with pytest.raises(SFTDataError, match=r"messages\[3\] \(assistant\) does not render"):
        assistant_mask_tokens(tok, messages, None)
    tokens, mask = assistant_mask_tokens(tok, messages, None, skip_mismatched=True)
    assert _trained_text(tok, tokens, mask) == ["Hello!<|im_end|>\n"]  # the trainer's fallback
