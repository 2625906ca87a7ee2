"""Distillation: training a student model towards a teacher's token distribution.

`distill_on_policy` runs on-policy distillation (the student samples, the teacher scores each
sampled token, the GRPO loss with per-token advantages teacher - student logprob trains the
student); `score_with_teacher` is its scoring stage on its own. See art_core/distill/on_policy.py.
"""

from art_core.distill.on_policy import TeacherError, distill_on_policy, score_with_teacher

__all__ = ["TeacherError", "distill_on_policy", "score_with_teacher"]
