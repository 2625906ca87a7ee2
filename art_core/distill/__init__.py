"""Distillation into a trainable model, two ways.

- `distill`: run the user's rollout with a teacher, keep the best trajectories of each group,
  one SFT step on them (art_core/distill/from_teacher.py).
- `distill_on_policy`: the student samples, the teacher scores each sampled token, the GRPO
  loss with per-token advantages teacher - student logprob trains the student (reverse KL on
  the student's own samples); `score_with_teacher` is its scoring stage on its own
  (art_core/distill/on_policy.py).
"""

from art_core.distill.from_teacher import best_of_groups, distill, teacher_model
from art_core.distill.on_policy import TeacherError, distill_on_policy, score_with_teacher

__all__ = ["TeacherError", "best_of_groups", "distill", "distill_on_policy",
           "score_with_teacher", "teacher_model"]
