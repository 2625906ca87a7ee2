"""Token in, token out with real tokenizers (no engine): the gateway's Splicer builds each
continued turn's prompt from the ids it served before, so a multi-turn conversation trains as
one sequence equal to what the engine saw and sampled; a rewritten history splits, with its
reason in the step's metrics.

Families: SmolLM2 (the embedded model's tokenizer with our tools template), and "tiny" Qwen3 and
Gemma 3: the same BPE with each family's special tokens and the family's own chat template (as
TRL ships them), which is what the splice depends on. Qwen3's template rewrites history
(strips earlier reasoning, drops empty think wrappers); Gemma 3's refuses tool roles, so its
conversation is plain turns."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("transformers")

from art_core.config import EngineConfig  # noqa: E402
from art_core.inference.chat_tokens import check_template  # noqa: E402
from art_core.inference.splice import Splicer, chat_response, completions_body  # noqa: E402
from art_core.train.batch import build_all_sequences  # noqa: E402
from art_core.trajectory import SampledTurn, Trajectory  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                   "required": ["q"]}}}]

FAMILIES = {  # name: (extra special tokens, TRL template file or None, end-of-turn token)
    "smollm2": ([], None, "<|im_end|>"),
    "qwen3": (["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>"], "qwen3.jinja", "<|im_end|>"),
    "gemma3": (["<bos>", "<start_of_turn>", "<end_of_turn>"], "gemma3.jinja", "<end_of_turn>"),
}


def family_dir(smollm2_tokenizer: Any, family: str, root: Path) -> Path:
    """A tokenizer directory for `family`, loadable by AutoTokenizer (as the gateway loads it)."""
    import copy

    specials, template, _ = FAMILIES[family]
    tok = copy.deepcopy(smollm2_tokenizer)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": specials})
    if template:
        spec = importlib.util.find_spec("trl")
        if spec is None or not spec.submodule_search_locations:
            pytest.skip("trl (the bench extra) ships the family chat templates")
        path = Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / template
        tok.chat_template = path.read_text()
    out = root / family
    tok.save_pretrained(out)
    return out


def engine_for(path: Path, **config: Any) -> Any:
    return SimpleNamespace(served_name=f"m-{path.name}", model_path=str(path),
                           config=EngineConfig(**config))


def call(call_id: str, q: str, spaced: bool = True) -> dict[str, Any]:
    """A tool call as a client sends it back: arguments re-serialised (spacing differs)."""
    args = json.dumps({"q": q}, separators=(", ", ": ") if spaced else (",", ":"))
    return {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": args}}


def sampled(tok: Any, pieces: list[str], eot: str) -> list[int]:
    """Completion ids as a model samples them: piece by piece (e.g. "p" + "en", where the whole
    text would tokenize as "pen"), ending with the end-of-turn token."""
    ids = [i for p in pieces for i in tok.encode(p, add_special_tokens=False)]
    return ids + [tok.convert_tokens_to_ids(eot)]


def script(family: str, thinking: bool) -> list[tuple[list[str], dict[str, Any], list[dict]]]:
    """Three assistant turns: (sampled pieces, the message the client keeps, what follows)."""
    think = ["<think>\n", "I should look", " it up.", "\n</think>\n\n"] if thinking else []
    if family == "gemma3":  # its template has no tool role
        return [
            (["A p", "en is", " a tool."], {"role": "assistant", "content": "A pen is a tool."},
             [{"role": "user", "content": "For what?"}]),
            (["For wr", "iting."], {"role": "assistant", "content": "For writing."},
             [{"role": "user", "content": "Thanks!"}]),
            (["You are", " welcome."], {"role": "assistant", "content": "You are welcome."},
             []),
        ]
    return [
        ([*think, '<tool_call>\n{"name": "lookup", "arguments": {"q": "p', 'en"}}\n</tool_call>'],
         {"role": "assistant", "content": "", "tool_calls": [call("call_1", "pen")]},
         [{"role": "tool", "tool_call_id": "call_1", "content": "a writing tool"}]),
        ([*think, '<tool_call>\n{"name": "lookup", "arguments": {"q": "rem', 'ove"}}\n'
          '</tool_call>'],
         {"role": "assistant", "content": "", "tool_calls": [call("call_2", "remove", False)]},
         [{"role": "tool", "tool_call_id": "call_2", "content": "to take away"}]),
        (["A pen", " writes", "."], {"role": "assistant", "content": "A pen writes."}, []),
    ]


async def converse(splicer: Splicer, engine: Any, tok: Any, family: str, thinking: bool
                   ) -> tuple[Trajectory, list[Any]]:
    """Serve the script through the Splicer as the gateway does (first turn rendered as vLLM
    would, later turns spliced) and record it as a Trajectory."""
    kwargs = None if family != "qwen3" else {"enable_thinking": thinking}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You help."},
                                      {"role": "user", "content": "What is a pen?"}]
    tools = None if family == "gemma3" else TOOLS
    turns, plans = [], []
    for pieces, kept, follow in script(family, thinking):
        body = {"messages": list(messages), "tools": tools, "chat_template_kwargs": kwargs}
        plan = await splicer.plan(engine, body)
        plans.append(plan)
        prompt = plan.prompt_ids if plan.spliced else tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True,
            return_dict=False, **(kwargs or {}))
        completion = sampled(tok, pieces, FAMILIES[family][2])
        splicer.remember(engine, body, {"prompt_token_ids": prompt, "choices": [
            {"token_ids": completion, "message": kept}]})
        turns.append(SampledTurn(message_index=len(messages), prompt_token_ids=list(prompt),
                                 completion_token_ids=completion,
                                 logprobs=[-0.5] * len(completion), spliced=plan.spliced,
                                 splice_reason=plan.reason))
        messages += [kept, *follow]
    return Trajectory(messages=messages, tools=tools, turns=turns, reward=1.0), plans


CASES = [pytest.param("smollm2", False, id="smollm2"),
         pytest.param("qwen3", False, id="qwen3-no-thinking"),
         pytest.param("qwen3", True, id="qwen3-thinking"),
         pytest.param("gemma3", False, id="gemma3")]


@pytest.mark.parametrize("family,thinking", CASES)
async def test_three_turns_train_as_one_sequence_of_the_served_ids(
        smollm2_tokenizer, tmp_path, family, thinking):
    path = family_dir(smollm2_tokenizer, family, tmp_path)
    splicer, engine = Splicer(), engine_for(path)
    tok = (await splicer.prepare(engine), splicer._tokenizers[engine.served_name])[1]
    trajectory, plans = await converse(splicer, engine, tok, family, thinking)

    assert [p.spliced for p in plans] == [False, True, True]
    sequences, metrics = build_all_sequences([(trajectory, 1.0)])
    last = trajectory.turns[-1]
    assert len(sequences) == 1
    assert sequences[0].token_ids == last.prompt_token_ids + last.completion_token_ids
    assert metrics["sequences_per_history"] == 1.0
    assert metrics["redundant_token_ratio"] == 1.0
    for turn in trajectory.turns:  # every sampled id is trained as sampled, where it was
        at = len(turn.prompt_token_ids)
        assert sequences[0].token_ids[at: at + len(turn.completion_token_ids)] == \
            turn.completion_token_ids
        assert all(sequences[0].mask[at: at + len(turn.completion_token_ids)])

    # what is added after each completion is what the template writes for the new messages:
    # the full rendering's tail, from the first token after the end-of-turn marker
    full = tok.apply_chat_template(trajectory.messages[: trajectory.turns[1].message_index],
                                   tools=trajectory.tools, add_generation_prompt=True,
                                   tokenize=False, **({"enable_thinking": thinking}
                                                      if family == "qwen3" else {}))
    first = trajectory.turns[0]
    added = trajectory.turns[1].prompt_token_ids[
        len(first.prompt_token_ids) + len(first.completion_token_ids):]
    assert full.endswith(tok.decode(added))


@pytest.mark.parametrize("family,thinking", CASES)
def test_template_check_passes_for_the_families(smollm2_tokenizer, tmp_path, family, thinking):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family_dir(smollm2_tokenizer, family, tmp_path))
    kwargs = {"enable_thinking": thinking} if family == "qwen3" else None
    assert check_template(tok, kwargs) == []


def test_template_check_names_what_breaks(smollm2_tokenizer):
    import copy

    tok = copy.deepcopy(smollm2_tokenizer)
    # a template that writes nothing between turns: where one ends cannot be found
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    problems = check_template(tok)
    assert problems and all("writes nothing after an assistant turn" in p for p in problems)


async def history_after_two_turns(smollm2_tokenizer, tmp_path) -> tuple[Splicer, Any, list]:
    path = family_dir(smollm2_tokenizer, "smollm2", tmp_path)
    splicer, engine = Splicer(), engine_for(path)
    await splicer.prepare(engine)
    tok = splicer._tokenizers[engine.served_name]
    trajectory, _ = await converse(splicer, engine, tok, "smollm2", False)
    return splicer, engine, trajectory.messages


@pytest.mark.parametrize("edit,reason", [
    pytest.param(lambda m: m[:2] + m[4:], "rewritten_history", id="dropped-turn"),
    pytest.param(lambda m: [*m[:5], {**m[5], "content": "A pen writes!"}, *m[6:]],
                 "rewritten_history", id="edited-last-answer"),
    pytest.param(lambda m: [{**m[0], "content": "You are terse."}, *m[1:]],
                 "rewritten_history", id="new-system-prompt"),
    pytest.param(lambda m: [*m[:3], {**m[3], "content": "a pencil"}, *m[4:]],
                 "rewritten_history", id="edited-tool-result"),
    pytest.param(lambda m: [m[0], {"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": "Hello! Ask me."}, *m[1:2]],
                 "unknown_prior_turn", id="client-written-example"),
])
async def test_a_rewritten_history_is_not_spliced_and_says_why(
        smollm2_tokenizer, tmp_path, edit, reason):
    splicer, engine, messages = await history_after_two_turns(smollm2_tokenizer, tmp_path)
    follow = [*edit(messages), {"role": "user", "content": "And a pencil?"}]
    plan = await splicer.plan(engine, {"messages": follow, "tools": TOOLS})
    assert not plan.spliced and plan.reason == reason
    # the untouched history still splices
    same = await splicer.plan(engine, {"messages": [*messages, {"role": "user",
                                                                "content": "And a pencil?"}],
                                       "tools": TOOLS})
    assert same.spliced


@pytest.mark.parametrize("change,reason", [
    pytest.param({"tools": None}, "rewritten_history", id="other-tools"),
    pytest.param({"chat_template": "{{ messages }}"}, "unsupported_request", id="own-template"),
    pytest.param({"add_generation_prompt": False}, "unsupported_request", id="no-gen-prompt"),
])
async def test_requests_the_splice_cannot_reproduce_go_to_the_chat_route(
        smollm2_tokenizer, tmp_path, change, reason):
    splicer, engine, messages = await history_after_two_turns(smollm2_tokenizer, tmp_path)
    body = {"messages": [*messages, {"role": "user", "content": "More?"}], "tools": TOOLS,
            **change}
    plan = await splicer.plan(engine, body)
    assert not plan.spliced and plan.reason == reason


async def test_splicing_off_and_other_tool_parsers_say_so(smollm2_tokenizer, tmp_path):
    path = family_dir(smollm2_tokenizer, "smollm2", tmp_path)
    body = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "bye"}], "tools": TOOLS}
    off = await Splicer().plan(engine_for(path, splice_turns=False), body)
    other = await Splicer().plan(engine_for(path, tool_call_parser="mistral"), body)
    assert (off.reason, other.reason) == ("splicing_off", "tool_parser_unsupported")


def test_a_split_is_counted_with_its_reason_and_its_redundant_tokens():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]
    turns = [SampledTurn(message_index=1, prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                         logprobs=[-1.0, -1.0]),
             SampledTurn(message_index=3, prompt_token_ids=[1, 2, 9, 9, 9, 7],
                         completion_token_ids=[8], logprobs=[-1.0], spliced=False,
                         splice_reason="rewritten_history", finish_reason="length")]
    trajectory = Trajectory(messages=messages, turns=turns, reward=1.0)
    sequences, metrics = build_all_sequences([(trajectory, 1.0)])
    assert len(sequences) == 2
    assert metrics["sequences_per_history"] == 2.0
    assert metrics["splits_rewritten_history"] == 1
    assert metrics["truncated_turns"] == 1
    # 12 tokens; the second prompt re-states the 5 tokens of the first sequence
    assert metrics["tokens"] == 12
    assert metrics["redundant_token_ratio"] == pytest.approx(12 / 7)


def test_grammar_chosen_tokens_have_no_sampler_logprob():
    import math

    turn = SampledTurn(message_index=1, prompt_token_ids=[1, 2], completion_token_ids=[3, 4, 5],
                       logprobs=[-0.1, -0.2, -0.3], constrained_from=1)
    trajectory = Trajectory(messages=[{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a"}],
                            turns=[turn], reward=1.0)
    sequences, metrics = build_all_sequences([(trajectory, 1.0)])
    old = sequences[0].old_logprobs
    assert old[2] == -0.1 and math.isnan(old[3]) and math.isnan(old[4])
    assert metrics["constrained_tokens"] == 2


def test_a_completions_answer_reads_as_a_chat_completion_with_tool_calls():
    body = completions_body({"model": "m", "messages": [], "tools": TOOLS, "max_tokens": 64,
                             "top_logprobs": 2, "temperature": 1.0, "stream": False},
                            [1, 2, 3])
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 64
    assert body["logprobs"] == 2 and body["return_token_ids"] is True
    assert not {"messages", "tools", "top_logprobs", "stream"} & body.keys()
    text = 'Sure.<tool_call>\n{"name": "lookup", "arguments": {"q": "pen"}}\n</tool_call>'
    data = {"id": "cmpl-abc", "model": "m", "created": 1, "usage": {"completion_tokens": 2},
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "token_ids": [7, 8],
                         "logprobs": {"tokens": ["Sure", "."], "token_logprobs": [-0.1, -0.2],
                                      "top_logprobs": [{"Sure": -0.1, "Yes": -2.0},
                                                       {".": -0.2, "!": -3.0}]}}]}
    chat = chat_response(data, [1, 2, 3], tools=True, top_logprobs=1)
    choice = chat["choices"][0]
    assert chat["id"] == "chatcmpl-abc" and chat["object"] == "chat.completion"
    assert chat["prompt_token_ids"] == [1, 2, 3] and choice["token_ids"] == [7, 8]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "lookup"
    assert json.loads(tc["function"]["arguments"]) == {"q": "pen"}
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.1, -0.2]
    assert [len(c["top_logprobs"]) for c in content] == [1, 1]


# ---- the gateway path, against a scripted upstream -----------------------------------------


@pytest.fixture
def spliced_gateway(smollm2_tokenizer, tmp_path):
    """A gateway whose engine has the SmolLM2 tokenizer and a scripted upstream; returns
    (gateway, [(path, body) sent], replies, tokenizer)."""
    import httpx

    from art_core.inference.engine import VLLMEngine
    from art_core.inference.gateway import Gateway

    path = family_dir(smollm2_tokenizer, "smollm2", tmp_path)
    sent: list[tuple[str, dict[str, Any]]] = []
    replies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json=replies.pop(0))

    gw = Gateway()
    gw.add_engine(VLLMEngine(str(path), served_name="base"))
    gw._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return gw, sent, replies, smollm2_tokenizer


async def test_a_continued_chat_goes_to_vllm_as_ids_and_comes_back_as_a_chat_completion(
        spliced_gateway):
    import httpx
    import openai

    from art_core import Trajectory as Traj

    gw, sent, replies, tok = spliced_gateway
    client = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="x", http_client=httpx.AsyncClient(
        transport=httpx.ASGITransport(app=gw.app), base_url="http://gw/v1"))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is a pen?"}]
    prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    first = sampled(tok, ['<tool_call>\n{"name": "lookup", "arguments": {"q": "p', 'en"}}\n'
                          '</tool_call>'], "<|im_end|>")
    replies.append({"id": "chatcmpl-1", "object": "chat.completion", "created": 1,
                    "model": "base", "prompt_token_ids": prompt, "choices": [{
                        "index": 0, "finish_reason": "tool_calls", "token_ids": first,
                        "message": {"role": "assistant", "content": None,
                                    "tool_calls": [call("chatcmpl-tool-1", "pen")]},
                        "logprobs": {"content": [{"token": "x", "logprob": -0.1}] * len(first)}}],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(first),
                              "total_tokens": len(prompt) + len(first)}})
    r1 = await client.chat.completions.create(model="base", messages=messages, tools=TOOLS)
    traj = Traj(messages=list(messages), tools=TOOLS)
    traj.add_completion(r1)
    assert sent[-1][0] == "/v1/chat/completions" and not traj.turns[0].spliced
    born = sent[-1][1]["priority"]  # oldest_first: the conversation's age is its priority
    traj.messages.append({"role": "tool", "tool_call_id": "chatcmpl-tool-1",
                          "content": "a writing tool"})

    text = '<tool_call>\n{"name": "lookup", "arguments": {"q": "ink"}}\n</tool_call>'
    second = sampled(tok, [text], "<|im_end|>")
    replies.append({"id": "cmpl-2", "object": "text_completion", "created": 2, "model": "base",
                    "choices": [{"index": 0, "text": text, "finish_reason": "stop",
                                 "token_ids": second, "logprobs": {
                                     "tokens": ["t"] * len(second),
                                     "token_logprobs": [-0.2] * len(second)}}],
                    "usage": {"prompt_tokens": 99, "completion_tokens": len(second),
                              "total_tokens": 99 + len(second)}})
    r2 = await client.chat.completions.create(model="base", messages=traj.messages, tools=TOOLS)
    route, up = sent[-1]
    assert route == "/v1/completions"
    assert up["prompt"][: len(prompt) + len(first)] == prompt + first
    assert "messages" not in up and up["return_token_ids"] is True
    assert up["priority"] == born  # a later turn keeps its conversation's place
    (tc,) = r2.choices[0].message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("lookup", {"q": "ink"})
    assert r2.choices[0].finish_reason == "tool_calls"
    assert r2.model_extra["prompt_token_ids"] == up["prompt"]
    traj.add_completion(r2)
    assert traj.turns[1].spliced and traj.turns[1].logprobs == [-0.2] * len(second)
    assert gw.ledger[r2.id]["choices"][0]["token_ids"] == second
    sequences, metrics = build_all_sequences([(traj, 1.0)])
    assert metrics["sequences_per_history"] == 1.0 and len(sequences) == 1

    # streamed: the same answer arrives as chunks (buffered: the completions route's own
    # chunks would be text, not chat deltas)
    traj.messages.append({"role": "tool", "tool_call_id": tc.id, "content": "a liquid"})
    replies.append({**replies_last("Ink is a liquid.", tok), "id": "cmpl-3"})
    stream = await client.chat.completions.create(model="base", messages=traj.messages,
                                                  tools=TOOLS, stream=True)
    chunks = [c async for c in stream]
    assert sent[-1][0] == "/v1/completions" and "stream" not in sent[-1][1]
    assert sent[-1][1]["priority"] == born
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == \
        "Ink is a liquid."


def test_older_conversations_get_earlier_priorities():
    import time

    from art_core.inference.completions import priority

    now = time.time()
    assert 0 <= priority(now - 5) < priority(now) < priority(now + 0.01)


def replies_last(text: str, tok: Any) -> dict[str, Any]:
    ids = sampled(tok, [text], "<|im_end|>")
    return {"object": "text_completion", "created": 3, "model": "base",
            "choices": [{"index": 0, "text": text, "finish_reason": "stop", "token_ids": ids,
                         "logprobs": {"tokens": ["t"] * len(ids),
                                      "token_logprobs": [-0.3] * len(ids)}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": len(ids), "total_tokens": 9}}
