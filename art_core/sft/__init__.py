"""Supervised fine-tuning data: chat-format examples (OpenAI's JSONL format, or dicts and
trajectories passed in code) checked and turned into `Trajectory` objects to train on.

Light like the core: importing it pulls in neither torch nor transformers."""

from art_core.sft.data import SFTDataError, as_trajectories, load_chat_jsonl

__all__ = ["SFTDataError", "as_trajectories", "load_chat_jsonl"]
