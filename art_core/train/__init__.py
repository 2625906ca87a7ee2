"""The trainer: advantages, training sequences, the GRPO loss and the LoRA step (torch lives here)."""
