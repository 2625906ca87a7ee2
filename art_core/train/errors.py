"""Errors of a training step that the backend must tell apart (light: no torch)."""


class RetryableStepError(RuntimeError):
    """A step failed for a reason a retry can fix (a rank died, ranks timed out): nothing was
    committed and its journaled groups stay for `replay_interrupted`."""
