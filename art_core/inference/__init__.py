"""The request path to vLLM: its supervisor and worker extension, merged weights, the recording
gateway and its ledger, strict tool calls (vllm, fastapi, httpx live here)."""
