"""Model and project names become path components: only safe ones are accepted."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from art_core.model import Model, TrainableModel, validate_name

ACCEPTED = ["my-model", "a.b_c-1", "x", "X" * 128, "v1.0", "...a", "Qwen3_4B"]
REJECTED = [
    "../x",
    "",
    "a/b",
    "/abs",
    "..",
    ".",
    "...",
    "x" * 129,
    "a b",
    "a\\b",
    "a\nb",
    "abc\n",  # a trailing newline once slipped past the '$' anchor
    "a:b",
    "é",
    "a\x00b",
]
FIELDS = [("name", "model name"), ("project", "project name")]


@pytest.mark.parametrize("value", ACCEPTED)
@pytest.mark.parametrize(("field", "what"), FIELDS)
def test_accepted(field, what, value):
    assert validate_name(value, what) == value
    model = TrainableModel(**{"name": "m", field: value})
    assert getattr(model, field) == value


@pytest.mark.parametrize("value", REJECTED)
@pytest.mark.parametrize(("field", "what"), FIELDS)
def test_rejected_with_the_bad_value_named(field, what, value):
    with pytest.raises(ValueError) as direct:
        validate_name(value, what)
    assert f"invalid {what} {value!r}" in str(direct.value)

    with pytest.raises(ValidationError) as info:
        TrainableModel(**{"name": "m", field: value})
    assert f"invalid {what} {value!r}" in str(info.value)
    assert [e["loc"] for e in info.value.errors()] == [(field,)]


@pytest.mark.parametrize("value", REJECTED)
@pytest.mark.parametrize(("field", "what"), FIELDS)
def test_rejected_on_assignment(field, what, value):
    model = TrainableModel(name="m", project="p")
    with pytest.raises(ValidationError, match="invalid " + what):
        setattr(model, field, value)
    assert (model.name, model.project) == ("m", "p")


@pytest.mark.parametrize("value", [None, 3, b"abc"])
def test_non_string_rejected(value):
    with pytest.raises(ValueError, match="invalid name"):
        validate_name(value)  # type: ignore[arg-type]


def test_inference_model_name_is_free_form():
    # a plain Model names a served model (e.g. "org/model"); it never becomes a path
    assert Model(name="Qwen/Qwen3-4B").name == "Qwen/Qwen3-4B"


def test_a_killed_conversions_leftover_is_removed_by_the_next_one(tmp_path, monkeypatch):
    import os
    import time

    from art_core import base_models

    models = tmp_path / "models"
    stale, fresh = models / ".tmp-smollm2-old", models / ".tmp-smollm2-running"
    for d in (stale, fresh):
        d.mkdir(parents=True)
    old = time.time() - 2 * base_models.STALE_CONVERSION_S
    os.utime(stale, (old, old))

    def convert(gguf, out):  # the conversion itself is the slow part, not what is tested
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(base_models, "_convert_gguf", convert)
    target = base_models.ensure_default_model(tmp_path)
    assert (target / "config.json").exists()
    assert not stale.exists() and fresh.exists()  # another process's may still be running
    assert sorted(p.name for p in models.iterdir()) == [".tmp-smollm2-running", target.name]


def test_openai_client_is_reused_per_loop_and_remade_after_close():
    import asyncio

    from art_core import Model

    model = Model(name="m", base_url="http://127.0.0.1:9/v1")

    async def in_one_loop():
        a, b = model.openai_client(), model.openai_client()
        other = model.openai_client(max_retries=0)
        assert a is b and other is not a
        await a.close()
        c = model.openai_client()
        assert c is not a and not c.is_closed()
        return c

    first, second = asyncio.run(in_one_loop()), asyncio.run(in_one_loop())
    assert first is not second  # a client belongs to the loop it was made in
