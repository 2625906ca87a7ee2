"""LocalBackend's gateway socket is guarded as `art serve`'s is (ARCHITECTURE invariant 8): no
non-loopback bind without a key; with one, every route but /health needs it; bodies are capped.
Real sockets, a stand-in engine."""

from __future__ import annotations

import httpx
import pytest

from art_core import LocalBackend, TrainableModel
from tests.support.runs import StubEngine


def test_a_public_bind_without_a_key_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="without an API key"):
        LocalBackend(tmp_path / "run", host="0.0.0.0")
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


async def test_a_public_bind_needs_the_key_and_caps_bodies(tiny_models, tmp_path):
    backend = LocalBackend(tmp_path / "run", host="0.0.0.0", api_key="s3cret",
                           max_body_bytes=4096)
    model = TrainableModel(name="agent", project="demo", base_model=str(tiny_models["llama"]))
    engine = StubEngine(model.base_model)
    backend._engines[model.base_model] = engine  # type: ignore[assignment]
    backend.gateway.add_engine(engine)  # type: ignore[arg-type]
    try:
        await model.register(backend)
        assert model.api_key == "s3cret"  # the model's own clients send it
        port = backend.base_url.rsplit(":", 1)[1].split("/")[0]
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/v1/models")).status_code == 401
            assert (await http.get("/health")).status_code == 200
            ok = await http.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200
            big = await http.post("/v1/chat/completions", content=b"x" * 10_000,
                                  headers={"Authorization": "Bearer s3cret",
                                           "Content-Type": "application/json"})
            assert big.status_code == 413
            assert big.json()["error"]["code"] == "body_too_large"
    finally:
        await backend.close()
