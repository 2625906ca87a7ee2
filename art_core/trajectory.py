"""The data model every part shares: `Trajectory` and `TrajectoryGroup`.

A trajectory is one rollout: the messages of a conversation in OpenAI chat format, the tools
offered, a reward, and for every assistant turn the model *sampled* a `SampledTurn` with the exact
token ids and logprobs the engine produced. Training uses those records, never a re-rendering of
the text (ARCHITECTURE invariant 1). An assistant message without a record is context only.

Both models have a stable JSON form; groups round-trip through JSONL files exactly.
"""

from __future__ import annotations

import math
import os
import traceback as tb
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from art_core.protocol import read_response

ROLES = ("system", "developer", "user", "assistant", "tool")
Scalar = str | int | float | bool | None

ZERO_VARIANCE_TOL = 1e-8
"""A group whose rewards span no more than this is 'all equal' and carries no signal."""


def has_signal(rewards: list[float]) -> bool:
    """Whether GRPO can learn from a group with these rewards: at least two of them, not all
    equal (ARCHITECTURE invariants 7 and 10). The trainer drops the others; dynamic sampling
    draws more scenarios in their place."""
    return len(rewards) >= 2 and max(rewards) - min(rewards) > ZERO_VARIANCE_TOL


def _check_finite_metadata(v: dict[str, Scalar]) -> dict[str, Scalar]:
    # JSON has no NaN/inf: pydantic would write them as null, so the round trip would lose them
    for k, x in v.items():
        if isinstance(x, float) and not math.isfinite(x):
            raise ValueError(f"metadata[{k!r}] must be finite, got {x}")
    return v


class SampledTurn(BaseModel):
    """The exact tokens behind one sampled assistant message.

    `prompt_token_ids` is the whole prompt as the engine saw it (chat template applied), so a
    multi-turn trajectory can be checked for prefix extension and trained without re-tokenizing.
    """

    model_config = ConfigDict(extra="forbid")

    message_index: int = Field(description="Index in `messages` of the assistant message sampled.")
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float] = Field(description="Sampling logprob of each completion token.")
    step: int | None = Field(default=None, description="Checkpoint step that sampled this turn.")
    response_id: str | None = None
    finish_reason: str | None = None
    started_at: float | None = Field(
        default=None, description="Unix time the gateway received the request (observability).")
    latency_s: float | None = Field(
        default=None, description="Seconds from request to complete response, at the gateway.")
    constrained_from: int | None = Field(default=None, ge=0, description=(
        "First completion token chosen under a tool-call grammar: its sampling logprob is of "
        "the masked distribution, not the model's, so the trainer uses its own (ratio 1)."))
    spliced: bool | None = Field(default=None, description=(
        "The prompt was the earlier turn's ids + sampled ids + the new messages (token in)."))
    splice_reason: str | None = Field(default=None, description=(
        "Why a continued conversation was re-rendered instead (e.g. 'unknown_prior_turn')."))
    teacher_logprobs: list[float] | None = Field(default=None, description=(
        "A teacher model's logprob of each completion token, given the same prompt and the "
        "tokens before it (on-policy distillation, art_core/distill/on_policy.py)."))
    reward: float | None = Field(default=None, description=(
        "This turn's own reward (per-turn credit): what a step environment gave for this reply, "
        "or what user code or a judge set with `set_turn_reward`. The trajectory's `reward` "
        "stays the episode's."))

    @model_validator(mode="after")
    def _lengths_match(self) -> SampledTurn:
        if len(self.logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries but completion_token_ids has "
                f"{len(self.completion_token_ids)}: they must be the same length"
            )
        if not self.completion_token_ids:
            raise ValueError("completion_token_ids is empty: a sampled turn has at least one token")
        if not all(math.isfinite(x) for x in self.logprobs):
            raise ValueError("logprobs contains NaN or an infinite value")
        if self.teacher_logprobs is not None:
            if len(self.teacher_logprobs) != len(self.completion_token_ids):
                raise ValueError(
                    f"teacher_logprobs has {len(self.teacher_logprobs)} entries but "
                    f"completion_token_ids has {len(self.completion_token_ids)}: they must be "
                    "the same length")
            if not all(math.isfinite(x) for x in self.teacher_logprobs):
                raise ValueError("teacher_logprobs contains NaN or an infinite value")
        if self.reward is not None and not math.isfinite(self.reward):
            raise ValueError(f"the reward of the turn at message {self.message_index} must be a "
                             f"finite number, got {self.reward}")
        return self


class History(BaseModel):
    """One conversation: messages (OpenAI chat format), tools offered and sampled-turn records.

    Assignments are validated (`traj.reward = float("nan")` raises at once)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = Field(
        default=None, description="Tool schemas offered, in OpenAI function format."
    )
    turns: list[SampledTurn] = Field(
        default_factory=list, description="Sampled-token records, one per trainable assistant turn."
    )

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        open_calls: set[str] = set()
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in ROLES:
                raise ValueError(f"messages[{i}].role is {role!r}; expected one of {ROLES}")
            if role == "assistant":
                for call in m.get("tool_calls") or []:
                    if "id" not in call:
                        raise ValueError(f"messages[{i}].tool_calls has a call without an id")
                    open_calls.add(call["id"])
            elif role == "tool":
                call_id = m.get("tool_call_id")
                if call_id not in open_calls:
                    raise ValueError(
                        f"messages[{i}] is a tool message with tool_call_id={call_id!r}, "
                        "which matches no tool call of an earlier assistant message"
                    )
        return messages

    @model_validator(mode="after")
    def _turns_point_at_assistant_messages(self) -> History:
        seen: set[int] = set()
        for turn in self.turns:
            i = turn.message_index
            if not 0 <= i < len(self.messages) or self.messages[i].get("role") != "assistant":
                raise ValueError(
                    f"turns[].message_index={i} does not point at an assistant message"
                )
            if i in seen:
                raise ValueError(f"turns has two records for message_index={i}")
            seen.add(i)
        return self

    @property
    def trainable(self) -> bool:
        """True when at least one assistant turn carries its sampled tokens."""
        return bool(self.turns)

    @property
    def turn_rewards(self) -> list[float | None]:
        """Each sampled turn's own reward, in `turns` order (None: not set)."""
        return [t.reward for t in self.turns]

    def set_turn_reward(self, turn: int, reward: float) -> None:
        """Give sampled turn `turn` (0-based, in `turns` order) its own reward; a turn that
        does not exist or a value that is not a finite number is refused, naming the turn."""
        if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn < len(self.turns):
            raise ValueError(f"turn {turn!r} does not exist: this conversation has "
                             f"{len(self.turns)} sampled turns (0..{len(self.turns) - 1})")
        if isinstance(reward, bool) or not isinstance(reward, int | float) or \
                not math.isfinite(reward):
            raise ValueError(f"the reward of turn {turn} must be a finite number, got {reward!r}")
        self.turns[turn] = self.turns[turn].model_copy(update={"reward": float(reward)})

    def add_completion(self, response: Any, choice: int = 0) -> dict[str, Any]:
        """Append the assistant message of a chat completion served by the art gateway, with
        the exact tokens it sampled (a trainable turn). Returns the message appended.

        `response` is the `openai` client's ChatCompletion (or its dict). The gateway returns
        `prompt_token_ids`, `choices[i].token_ids` and logprobs on every response.
        """
        data = response if isinstance(response, dict) else response.model_dump()
        ch = data["choices"][choice]
        msg = ch.get("message") or {}
        message: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["function"]["name"],
                              "arguments": c["function"]["arguments"]}}
                for c in msg["tool_calls"]
            ]
        sampled = read_response(data, choice)
        if sampled is None:
            raise ValueError(
                "the response carries no sampled token ids/logprobs: was it served by the art "
                "gateway (model.openai_client())? Append the message as context instead."
            )
        turn = SampledTurn(message_index=len(self.messages), **sampled)
        self.messages.append(message)
        self.turns.append(turn)
        return message


class Trajectory(History):
    """One rollout: its main conversation, a reward, and what the user wants to keep about it."""

    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, Scalar] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    additional_histories: list[History] = Field(
        default_factory=list,
        description="Separate conversations of the same rollout (sub-agents), trained alike.",
    )

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"reward must be a finite number, got {v}")
        return v

    @field_validator("metrics")
    @classmethod
    def _finite_metrics(cls, v: dict[str, float | int | bool]) -> dict[str, float | int | bool]:
        for k, x in v.items():
            if isinstance(x, float) and not math.isfinite(x):
                raise ValueError(f"metrics[{k!r}] must be finite, got {x}")
        return v

    @field_validator("metadata")
    @classmethod
    def _finite_metadata(cls, v: dict[str, Scalar]) -> dict[str, Scalar]:
        return _check_finite_metadata(v)

    def histories(self) -> Iterator[History]:
        """The main conversation, then any additional ones."""
        yield self
        yield from self.additional_histories

    @property
    def trainable(self) -> bool:
        return any(h.turns for h in self.histories())

    def log(self, message: str) -> None:
        self.logs.append(message)


class RolloutError(BaseModel):
    """An exception raised by a rollout, kept with its group so failures are visible."""

    model_config = ConfigDict(extra="forbid")

    type: str
    message: str
    traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> RolloutError:
        return cls(
            type=type(exc).__qualname__,
            message=str(exc),
            traceback="".join(tb.format_exception(exc)),
        )


class TrajectoryGroup(BaseModel):
    """Trajectories of one scenario, compared against each other by GRPO (and RULER)."""

    model_config = ConfigDict(extra="forbid")

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[RolloutError] = Field(default_factory=list)
    metadata: dict[str, Scalar] = Field(default_factory=dict)

    @field_validator("metadata")
    @classmethod
    def _finite_metadata(cls, v: dict[str, Scalar]) -> dict[str, Scalar]:
        return _check_finite_metadata(v)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    @property
    def has_signal(self) -> bool:
        """At least two trajectories whose rewards are not all equal (`has_signal`)."""
        return has_signal(self.rewards)


def write_groups_jsonl(groups: Iterable[TrajectoryGroup], path: str | Path) -> Path:
    """Write groups, one JSON object per line. The file is replaced atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for g in groups:
            f.write(g.model_dump_json())
            f.write("\n")
        f.flush()
        # on disk before the rename, so a crash cannot leave an empty journal (invariant 3)
        os.fsync(f.fileno())
    tmp.replace(path)
    return path


def read_groups_jsonl(path: str | Path) -> list[TrajectoryGroup]:
    """Read groups written by `write_groups_jsonl`; a bad line names its line number."""
    groups = []
    with Path(path).open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                groups.append(TrajectoryGroup.model_validate_json(line))
            except ValueError as e:
                raise ValueError(f"{path}:{n}: invalid trajectory group: {e}") from e
    return groups


def check_groups(groups: Any) -> list[TrajectoryGroup]:
    """The `groups` argument of `train`: a non-empty list of TrajectoryGroup (or one group)
    whose rewards are finite numbers (a NaN reward would train for minutes and then fail on
    a NaN gradient norm that names nothing)."""
    if isinstance(groups, TrajectoryGroup):
        groups = [groups]
    groups = list(groups)
    if not groups:
        raise ValueError("train() needs at least one TrajectoryGroup")
    for i, g in enumerate(groups):
        if not isinstance(g, TrajectoryGroup):
            raise TypeError(f"groups[{i}] is a {type(g).__name__}, not a TrajectoryGroup")
        for j, t in enumerate(g.trajectories):
            if not isinstance(t.reward, int | float) or not math.isfinite(t.reward):
                raise ValueError(f"groups[{i}].trajectories[{j}].reward is {t.reward!r}: a "
                                 "reward must be a finite number (not NaN or infinite)")
    return groups


def continues(turn: SampledTurn, previous: SampledTurn | None) -> bool:
    """True when `turn`'s prompt starts with everything `previous` saw and sampled, so both
    train as one sequence (art_core/train/batch.py); False marks a split."""
    if previous is None:
        return False
    seen = previous.prompt_token_ids + previous.completion_token_ids
    return turn.prompt_token_ids[: len(seen)] == seen


def split_reason(turn: SampledTurn) -> str:
    """Why `turn` did not continue the sequence before it (step metrics `splits_<reason>`)."""
    if turn.spliced:
        return "splice_mismatch"  # token in, yet not a prefix: a gateway bug, never expected
    return turn.splice_reason or "not_prefix"  # not_prefix: recorded without the gateway's say


def longest_sequence(trajectory: Trajectory) -> int:
    """Tokens of the longest sequence a trajectory trains as: a turn's prompt and completion
    (a later turn that extends an earlier one contains it)."""
    return max((len(t.prompt_token_ids) + len(t.completion_token_ids)
                for h in trajectory.histories() for t in h.turns), default=0)


def check_sequence_lengths(groups: list[TrajectoryGroup], limit: int | None) -> None:
    """Raise ValueError naming the first trajectory with a sequence longer than `limit`."""
    if limit is None:
        return
    for i, g in enumerate(groups):
        for j, t in enumerate(g.trajectories):
            n = longest_sequence(t)
            if n > limit:
                raise ValueError(
                    f"groups[{i}].trajectories[{j}] has a sequence of {n} tokens, longer than "
                    f"the trainer's limit of {limit} (TrainConfig.max_sequence_tokens, by "
                    "default the base model's context length): shorten the rollout or raise "
                    "the limit")


def sampled_steps(trajectory: Trajectory) -> list[int]:
    """The checkpoint steps that sampled the trajectory's turns, in every history (turns the
    gateway did not mark with a step, e.g. served by another model, are left out)."""
    return [t.step for h in trajectory.histories() for t in h.turns if t.step is not None]


def steps_off_policy(group: TrajectoryGroup, policy_step: int) -> int:
    """How many steps behind `policy_step` the oldest turn of `group` was sampled (0 when
    every turn came from `policy_step` or no turn carries a step)."""
    steps = [s for t in group.trajectories for s in sampled_steps(t)]
    return max(0, policy_step - min(steps)) if steps else 0


def off_policy_metrics(groups: Iterable[TrajectoryGroup], policy_step: int) -> dict[str, float]:
    """How stale the sampled turns of a step's groups are, against the policy being trained
    (`policy_step`, the checkpoint the step starts from): `off_policy_steps_mean` and
    `off_policy_steps_max` over turns (steps behind the policy), `frac_turns_off_policy` (share
    of turns sampled by an older adapter). All 0 for a synchronous step."""
    behind = [max(0, policy_step - s) for g in groups for t in g.trajectories
              for s in sampled_steps(t)]
    if not behind:
        return {"off_policy_steps_mean": 0.0, "off_policy_steps_max": 0.0,
                "frac_turns_off_policy": 0.0}
    return {"off_policy_steps_mean": sum(behind) / len(behind),
            "off_policy_steps_max": float(max(behind)),
            "frac_turns_off_policy": sum(b > 0 for b in behind) / len(behind)}
