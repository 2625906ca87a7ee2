"""Distillation into a trainable model: from a teacher's rollouts (SFT on the best of them)."""

from art_core.distill.from_teacher import best_of_groups, distill, teacher_model

__all__ = ["best_of_groups", "distill", "teacher_model"]
