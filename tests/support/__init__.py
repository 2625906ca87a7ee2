"""Shared helpers of the test suite (no test module imports another): engine helpers, data,
a real `art serve` subprocess, a run directory without vLLM, a headless browser, and scripts
run in subprocesses (torchrun ranks, SkyPilot checks)."""
