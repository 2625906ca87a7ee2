"""Pipelined RL: rollouts keep running while the model trains (art_core/pipeline/trainer.py)."""

from art_core.pipeline.store import PipelineStore
from art_core.pipeline.trainer import PipelineResult, PipelineTrainer

__all__ = ["PipelineResult", "PipelineStore", "PipelineTrainer"]
