"""An OpenEnv environment served by OpenEnv's own `create_app`, run in the side environment
`.venv-openenv` (`python tests/support/openenv_server.py PORT`): the number-guessing game of
tests/support/step_envs.py written as an OpenEnv `Environment`, with its typed action and
observation. It imports nothing of this repository (OpenEnv 0.10 pins an `mcp` the training
environment cannot have)."""

from __future__ import annotations

import sys
from typing import Any

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess a number from 1 to 10 in at most 3 tries: reward 1 for the right number, 0.1 for
    any reply with a number in it, else 0; `reset(target=...)` picks the number."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.target, self._state = 5, State(episode_id=None, step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self.target = int(kwargs.get("target", 5))
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text="Guess my number from 1 to 10. Reply with one number.")

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        digits = "".join(c if c.isdigit() else " " for c in action.message).split()
        guess = int(digits[0]) if digits else None
        won = guess == self.target
        done = won or self._state.step_count >= 3
        hint = "right" if won else "no number" if guess is None else (
            "higher" if guess < self.target else "lower")
        return GuessObservation(text=f"{hint}.", done=done,
                                reward=1.0 if won else 0.1 if guess is not None else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=64)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
