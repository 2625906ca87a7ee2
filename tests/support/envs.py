"""TRL-style tool environments for tests, written as TRL's docs write them (one instance per
rollout, `reset(**row)`, public methods are tools with type hints and Google docstrings,
`get_reward`)."""

from __future__ import annotations


class CounterEnv:
    """Adds numbers to a running total, which is the reward; `calls` keeps every call that
    reached a method."""

    def reset(self, **kwargs) -> str | None:
        self.total = int(kwargs.get("start", 0))
        self.calls: list[tuple[str, dict]] = []
        return f" The total starts at {self.total}."

    def add(self, amount: int) -> str:
        """Add an amount to the total.

        Args:
            amount: How much to add.
        """
        self.calls.append(("add", {"amount": amount}))
        self.total += amount
        return f"total {self.total}"

    async def shout(self, text: str) -> str:
        """Say something loudly.

        Args:
            text: What to say.
        """
        self.calls.append(("shout", {"text": text}))
        return text.upper()

    def explode(self, reason: str) -> str:
        """Fail on purpose.

        Args:
            reason: Why.
        """
        self.calls.append(("explode", {"reason": reason}))
        raise RuntimeError(f"exploded: {reason}")

    def get_reward(self) -> float:
        return float(self.total)


class NoTools:
    def reset(self, **kwargs) -> None:
        return None

    def get_reward(self) -> float:
        return 0.0


class Untyped:
    def reset(self, **kwargs) -> None:
        return None

    def move(self, where):
        """Move.

        Args:
            where: Where to.
        """
        return where


class NoReward:
    def reset(self, **kwargs) -> None:
        return None

    def look(self, at: str) -> str:
        """Look at something.

        Args:
            at: What to look at.
        """
        return at
