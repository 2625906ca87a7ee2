"""BFCL multi_turn_base without an engine, through BFCL's own code in the side environment
(art_bfcl/multi_turn.py via the worker): the ground truth, called one step at a time as
a model would (tool calls decoded and run by BFCL on the rollout's own API instances), passes
BFCL's multi-turn checker 200/200; empty answers fail 200/200; the per-turn signal counts the
turns that pass in a row; sessions do not share state; bad requests are clear errors."""

from __future__ import annotations

import json

import pytest

from art_bfcl.checker import (
    BfclWorker,
    MultiTurnItem,
    ground_truth_steps,
    step_calls,
    unavailable_reason,
)

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=str(unavailable_reason()))


@pytest.fixture(scope="module")
def worker():
    with BfclWorker() as w:
        yield w


@pytest.fixture(scope="module")
def items(worker) -> dict[str, MultiTurnItem]:
    return {i.id: i for i in worker.multi_turn()}


def test_the_category_is_bfcls_200_entries_with_their_tools(items):
    assert len(items) == 200
    first = items["multi_turn_base_0"]
    assert first.classes == ("TwitterAPI", "GorillaFileSystem") and len(first.turns) == 4
    names = {t["function"]["name"] for t in first.tools}
    assert {"cd", "mkdir", "mv", "grep", "sort", "diff"} <= names
    assert all(1 <= len(i.turns) == len(i.ground_truth) <= 7 for i in items.values())


def test_the_ground_truth_called_step_by_step_passes_and_empty_answers_fail(worker, items):
    passed, empty = 0, 0
    for item in items.values():
        session = f"truth-{item.id}"
        turns = ground_truth_steps(item)
        for turn in turns:
            for calls in turn:
                assert worker.execute(item, session, calls) is not None, (item.id, calls)
        verdict = worker.check_turns(item, turns)
        passed += verdict.valid and verdict.turns_passed == verdict.n_turns
        nothing = worker.check_turns(item, [[] for _ in turns])
        empty += nothing.valid or nothing.turns_passed > 0
        worker.end_session(session)
    assert (passed, empty) == (200, 0)


def test_turns_pass_in_a_row_from_the_first(worker, items):
    item = items["multi_turn_base_0"]  # 4 turns, each with calls to make
    truth = ground_truth_steps(item)
    table = [  # (the model's turns, valid, turns passed)
        (truth, True, 4),
        (truth[:1] + [[], [], []], False, 1),
        (truth[:2] + [[], []], False, 2),
        ([[]] + truth[1:], False, 0),  # later turns right after a wrong first: still 0
    ]
    for turns, valid, passed in table:
        v = worker.check_turns(item, turns)
        assert (v.valid, v.turns_passed, v.n_turns) == (valid, passed, 4), v


def test_a_rollout_that_ended_early_is_force_terminated(worker, items):
    item = items["multi_turn_base_0"]
    v = worker.check_turns(item, ground_truth_steps(item)[:2])
    assert not v.valid and v.error_type == "multi_turn:force_terminated"


def test_sessions_have_their_own_instances(worker, items):
    item = items["multi_turn_base_0"]
    cd = [{"cd": json.dumps({"folder": "document"})}]
    for session in ("a", "b"):
        assert worker.execute(item, session, cd) is not None
    worker.execute(item, "a", [{"mkdir": json.dumps({"dir_name": "made-in-a"})}])
    _, seen_a = worker.execute(item, "a", [{"ls": "{}"}])
    _, seen_b = worker.execute(item, "b", [{"ls": "{}"}])
    assert "made-in-a" in seen_a[0] and "made-in-a" not in seen_b[0]
    for session in ("a", "b"):
        worker.end_session(session)
    _, fresh = worker.execute(item, "a", [{"ls": "{}"}])  # a new session starts at the root
    assert "made-in-a" not in fresh[0]
    worker.end_session("a")


def test_calls_that_do_not_decode_end_the_turn(worker, items):
    item = items["multi_turn_base_0"]
    assert worker.execute(item, "s", []) is None
    assert worker.execute(item, "s", [{"cd": "{not json"}]) is None
    message = {"tool_calls": [{"id": "c", "type": "function",
                               "function": {"name": "cd", "arguments": '{"folder": "x"}'}}]}
    decoded, results = worker.execute(item, "s", step_calls(message))
    assert decoded == ["cd(folder='x')"] and len(results) == 1
    worker.end_session("s")


def test_bad_requests_are_clear_errors(worker, items):
    with pytest.raises(ValueError, match="unknown multi-turn category 'multi_turn_long"):
        worker.multi_turn("multi_turn_long_context")
    ghost = MultiTurnItem(id="multi_turn_base_9999", turns=[], tools=[])
    with pytest.raises(ValueError, match="no multi-turn item 'multi_turn_base_9999'"):
        worker.check_turns(ghost, [])


class Scripted:
    """An OpenAI-client stand-in that answers each request with the next scripted tool calls
    (a list of {name: arguments}), or text when the script says None, in the gateway's
    response form (sampled ids and logprobs), so the episode's logic is tested without an
    engine; the real path is tests/engine and benchmarks/bfcl_multiturn.py."""

    def __init__(self, script: list) -> None:
        self.script, self.asked = list(script), 0
        self.chat = self
        self.completions = self

    async def create(self, **request) -> dict:
        self.asked += 1
        calls = self.script.pop(0) if self.script else None
        tool_calls = [{"id": f"c{self.asked}-{k}", "type": "function",
                       "function": {"name": name, "arguments": args}}
                      for k, call in enumerate(calls or []) for name, args in call.items()]
        return {"id": f"r{self.asked}", "prompt_token_ids": [1, 2, 3],
                "choices": [{"index": 0, "finish_reason": "stop", "token_ids": [4, 5],
                             "logprobs": {"content": [{"token": "a", "logprob": -0.1},
                                                      {"token": "b", "logprob": -0.2}]},
                             "message": {"role": "assistant",
                                         "content": None if calls else "done",
                                         "tool_calls": tool_calls or None}}]}


def script_of(turns: list[list[list[dict]]]) -> list:
    """Each turn's steps, then a text answer that ends the turn."""
    return [step for steps in turns for step in [*steps, None]]


@pytest.mark.parametrize(("answer", "passed", "turns_passed"), [
    ("truth", 1.0, 4), ("first-turn-only", 0.0, 1), ("nothing", 0.0, 0)])
async def test_an_episode_scores_and_credits_each_user_turn(worker, items, answer, passed,
                                                            turns_passed):
    from art_bfcl.multi_turn_rollout import multi_turn_episode

    item = items["multi_turn_base_0"]
    truth = ground_truth_steps(item)
    turns = {"truth": truth, "first-turn-only": truth[:1] + [[]] * 3,
             "nothing": [[]] * 4}[answer]
    traj = await multi_turn_episode(Scripted(script_of(turns)), "m", item, worker)
    assert traj.metrics["passed"] == passed and traj.metrics["turns_passed"] == turns_passed
    assert traj.reward == pytest.approx(turns_passed / 4)
    rewarded = [r for r in traj.turn_rewards if r is not None]
    assert rewarded == [0.25] * turns_passed  # the last call of each turn that passed
    assert sum(rewarded) == pytest.approx(traj.reward)
    tool_results = [m for m in traj.messages if m["role"] == "tool"]
    assert len(tool_results) == sum(len(steps) for steps in turns)  # one per call run
    assert [m["content"] for m in traj.messages if m["role"] == "user"] == \
        [t[0]["content"] for t in item.turns]


async def test_an_episode_that_never_stops_calling_is_force_terminated(worker, items):
    from art_bfcl.multi_turn_rollout import MAX_STEPS, multi_turn_episode

    item = items["multi_turn_base_0"]
    forever = [[{"pwd": "{}"}]] * 100
    client = Scripted(forever)
    traj = await multi_turn_episode(client, "m", item, worker)
    assert client.asked == MAX_STEPS + 1  # BFCL: more than 20 steps in a turn ends it
    assert traj.metrics["force_quit"] == 1.0 and traj.metrics["passed"] == 0.0
    assert traj.reward == 0.0


def steps_of(messages: list[dict]) -> list[list[list[dict]]]:
    """The model steps of a conversation per user turn, as an episode hands them to the checker
    (a reply without a call is a step that ends the turn)."""
    turns: list[list[list[dict]]] = []
    for k, m in enumerate(messages):
        if m["role"] == "user" and (k == 0 or messages[k - 1]["role"] != "user"):
            turns.append([])
        elif m["role"] == "assistant":
            turns[-1].append(step_calls(m))
    return turns


def test_the_ground_truth_episode_is_the_conversation_that_passes(worker, items):
    """SFT data for a warm start: every entry's ground-truth conversation, its calls run by BFCL
    on the episode's own instances, passes BFCL's checker on every turn."""
    from art_bfcl import ground_truth_episode

    for item in items.values():
        traj = ground_truth_episode(item, worker)
        turns = steps_of(traj.messages)
        assert len(turns) == len(item.turns), item.id
        assert all(turn[-1] == [] for turn in turns)  # each user turn ends with a reply
        verdict = worker.check_turns(item, turns)
        assert verdict.valid and verdict.turns_passed == verdict.n_turns, (item.id, verdict)
        asked: set[str] = set()  # every tool message answers a call of the step before it
        for m in traj.messages:
            if m["role"] == "assistant":
                asked = {c["id"] for c in m.get("tool_calls") or []}
            elif m["role"] == "tool":
                assert m["tool_call_id"] in asked and isinstance(m["content"], str), item.id


def test_the_ground_truth_episode_trains_its_calls_and_replies(worker, items, smollm2_tokenizer):
    from art_bfcl import ground_truth_episode
    from art_core.sft.render import assistant_mask_tokens

    item = items["multi_turn_base_0"]
    traj = ground_truth_episode(item, worker, reply="All done.")
    tokens, mask = assistant_mask_tokens(smollm2_tokenizer, traj.messages, traj.tools, "all")
    trained = smollm2_tokenizer.decode([t for t, m in zip(tokens, mask, strict=True) if m])
    calls = [c["function"] for m in traj.messages for c in m.get("tool_calls") or []]
    assert len(calls) == sum(len(turn) for turn in ground_truth_steps(item))
    for c in calls:  # each call's name and argument names are in what trains
        assert c["name"] in trained
        assert all(f'"{key}"' in trained for key in json.loads(c["arguments"]))
    assert trained.count("All done.") == len(item.turns)
    result = max((m["content"] for m in traj.messages if m["role"] == "tool"), key=len)
    assert result not in trained and result in smollm2_tokenizer.decode(tokens)  # context only


def test_the_examples_split_holds_out_and_trains_the_shortest(worker, items, tmp_path):
    """examples/bfcl_multiturn_rl.py: held-out entries are never trained on; the training
    entries are the shortest of the rest; the split is saved, read back, and a split made with
    other settings is refused."""
    from tests.support.data import load_example

    example = load_example("bfcl_multiturn_rl")
    settings = example.Settings(train_entries=10)
    split = example.the_split(list(items.values()), tmp_path, settings)
    assert len(split["held_out"]) == 100 and len(split["train"]) == 10
    assert not set(split["held_out"]) & set(split["train"])
    longest_trained = max(example.size(items[i]) for i in split["train"])
    rest = set(items) - set(split["held_out"]) - set(split["train"])
    assert all(example.size(items[i]) >= longest_trained for i in rest)
    assert example.the_split(list(items.values()), tmp_path, settings) == split
    with pytest.raises(SystemExit, match="split.json was made with other settings"):
        example.the_split(list(items.values()), tmp_path, example.Settings(train_entries=11))


def test_the_examples_training_conversations_fit_the_context(worker, items, tmp_path,
                                                            smollm2_tokenizer):
    """The default training entries' ground-truth conversations fit the example's context, so
    the warm start skips none of them."""
    from art_bfcl import ground_truth_episode
    from art_core.sft.render import assistant_mask_tokens
    from tests.support.data import load_example

    example = load_example("bfcl_multiturn_rl")
    split = example.the_split(list(items.values()), tmp_path, example.Settings())
    lengths = [len(assistant_mask_tokens(smollm2_tokenizer, t.messages, t.tools)[0])
               for t in (ground_truth_episode(items[i], worker) for i in split["train"])]
    assert len(lengths) == example.Settings().train_entries
    assert max(lengths) <= example.CONTEXT
