"""Step environments and a scripted model for the step adapter's tests (art_core/env/steps.py):
environments in each shape `step_rollout` plays, and a model whose "gateway" answers with
scripted replies carrying token ids, so a rollout runs without an engine."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from art_core.env import Step


class ScriptedModel:
    """A stand-in for a TrainableModel: each request is answered with the next reply, as our
    gateway answers (prompt and completion token ids, logprobs); `asked` keeps each request's
    messages."""

    name = "scripted"

    def __init__(self, replies: list[str]) -> None:
        self.replies = iter(replies)
        self.asked: list[list[dict[str, Any]]] = []
        self.ids = itertools.count(1)

    def openai_client(self) -> Any:
        model = self

        class Completions:
            async def create(self, *, messages: list[dict[str, Any]], **_: Any) -> dict:
                model.asked.append([dict(m) for m in messages])
                text = next(model.replies)
                n = len(text.split()) or 1
                return {"id": f"r{next(model.ids)}", "prompt_token_ids": [1, 2, 3],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": text},
                                     "token_ids": list(range(5, 5 + n)),
                                     "logprobs": {"content": [{"logprob": -0.5}] * n}}]}

        class Client:
            chat = type("Chat", (), {"completions": Completions()})()

        return Client()


class GuessEnv:
    """Guess a number in 1..9: each reply is a guess; 0.1 for a guess closer than the last,
    1.0 for the number; done when found. `close` is counted."""

    def __init__(self, target: int = 6) -> None:
        self.target, self.closed = target, 0

    def reset(self, target: int | None = None) -> str:
        self.target = target or self.target
        self.last = 10
        return "Guess my number, 1 to 9."

    def step(self, reply: str) -> Step:
        guess = int("".join(c for c in reply if c.isdigit()) or 0)
        if guess == self.target:
            return Step(None, 1.0, True)
        closer = abs(guess - self.target) < self.last
        self.last = abs(guess - self.target)
        return Step("higher" if guess < self.target else "lower", 0.1 if closer else 0.0)

    def close(self) -> None:
        self.closed += 1


class TupleEnv:
    """An async environment whose step answers with the plain tuple."""

    async def reset(self) -> str:
        return "Say anything."

    async def step(self, reply: str) -> tuple[str, float, bool]:
        return ({"text": f"you said {reply}", "reward": 9}, 0.5, reply == "stop")


class BrokenEnv:
    """Fails at its second step: by raising, or by hanging (`hang=True`)."""

    def __init__(self, hang: bool = False) -> None:
        self.hang, self.steps, self.closed = hang, 0, 0

    def reset(self) -> str:
        return "Go."

    async def step(self, reply: str) -> Step:
        self.steps += 1
        if self.steps == 2:
            if self.hang:
                await asyncio.sleep(3600)
            raise ConnectionError("environment server went away")
        return Step("again", 0.25)

    def close(self) -> None:
        self.closed += 1
