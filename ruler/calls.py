"""What every judge call shares, whatever the mode: the lazy litellm import and the call metrics."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


def import_litellm() -> Any:
    """Import litellm on first use: it is slow to import and would fetch a price map online."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    # litellm prints "Give Feedback / Get Help" banners on every handled error (we handle 400s
    # and timeouts on purpose); our own log lines say what happened.
    litellm.suppress_debug_info = True
    return litellm


@dataclass
class CallStats:
    """What judging one group cost; becomes the `ruler_*` metrics."""

    calls: int = 0
    retries: int = 0
    format_fallbacks: int = 0
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None  # None while litellm knows no price for the judge

    def add_usage(self, litellm: Any, response: Any) -> None:
        usage = getattr(response, "usage", None)
        self.prompt_tokens += getattr(usage, "prompt_tokens", None) or 0
        self.completion_tokens += getattr(usage, "completion_tokens", None) or 0
        try:
            cost = float(litellm.completion_cost(completion_response=response))
        except Exception:  # litellm raises for models it has no price for (a local server)
            return
        self.cost_usd = (self.cost_usd or 0.0) + cost

    def metrics(self, cache_hit: bool = False) -> dict[str, float | int]:
        m: dict[str, float | int] = {
            "ruler_cache_hit": int(cache_hit),
            "ruler_judge_calls": self.calls,
            "ruler_retries": self.retries,
            "ruler_format_fallbacks": self.format_fallbacks,
            "ruler_latency_s": self.latency_s,
            "ruler_prompt_tokens": self.prompt_tokens,
            "ruler_completion_tokens": self.completion_tokens,
        }
        if self.cost_usd is not None:
            m["ruler_cost_usd"] = self.cost_usd
        return m
