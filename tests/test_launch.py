"""`art launch`: the SkyPilot task is parsed and validated by the real `sky` library (its task
and resources YAML schemas, name and run checks), the install hint shows without the extra, and `art serve`'s idle
exit (what lets SkyPilot's auto-stop fire) works. No cloud is contacted."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from art_core.cli import app
from art_core.idle import ActivityTracker, exit_when_idle
from art_core.launch import INSTALL_HINT, LaunchConfig, build_task, task_config

KEY = "k" * 43


@pytest.mark.parametrize("cfg", [
    LaunchConfig(),
    LaunchConfig(cluster="gpu-8", accelerators="H100:8", infra="k8s", port=8080,
                 idle_minutes=10, down=True, use_spot=True, disk_size=512,
                 allow_base_models=["Qwen/*"], envs={"HF_TOKEN": "x"}),
])
def test_sky_parses_and_validates_the_task(cfg):
    import sky

    # sky.Task.from_yaml_config (task + resources schemas) and the name/run checks; the full
    # Task.validate() also resolves accelerators in SkyPilot's catalog, which it downloads
    # from the network (not reachable here), so sky.launch does that part
    task = build_task(cfg, KEY)
    assert isinstance(task, sky.Task)
    # the same task survives SkyPilot's YAML round trip (what `sky launch task.yaml` reads)
    again = sky.Task.from_yaml_str(yaml.safe_dump(task_config(cfg, KEY)))
    assert again.run == task.run and again.setup == task.setup

    (res,) = list(task.resources)
    assert [str(p) for p in res.ports] == [str(cfg.port)]
    acc, count = cfg.accelerators.split(":")
    assert res.accelerators == {acc: int(count)}
    assert res.use_spot == cfg.use_spot
    auto = res.autostop_config
    assert auto is not None and auto.enabled
    assert auto.idle_minutes == cfg.idle_minutes and auto.down == cfg.down
    if cfg.infra:
        assert str(res.infra.cloud).lower() in ("kubernetes", "k8s")

    assert "uv pip install" in task.setup and '"$ART_VLLM" "$ART_PACKAGE"' in task.setup
    assert "art serve --host 0.0.0.0" in task.run and "--idle-exit-minutes" in task.run
    assert task.envs["ART_PORT"] == str(cfg.port)
    assert task.envs["ART_PACKAGE"] == cfg.package
    for k, v in cfg.envs.items():
        assert task.envs[k] == v
    # the key is a SkyPilot secret (redacted in its logs), not a plain env var
    assert "ART_API_KEY" not in task.envs
    secret = task.secrets["ART_API_KEY"]
    assert getattr(secret, "get_secret_value", lambda: secret)() == KEY
    for pattern in cfg.allow_base_models:
        assert f"--allow-base-model '{pattern}'" in task.run


def test_sky_rejects_what_it_cannot_run():
    bad = task_config(LaunchConfig(), KEY)
    bad["resources"]["autostop"]["idle_minuets"] = 5  # a typo: SkyPilot's schema refuses it
    import sky

    with pytest.raises(Exception, match="idle_minuets"):
        sky.Task.from_yaml_config(bad)
    with pytest.raises(ValueError, match="API key"):
        task_config(LaunchConfig(), "")


def test_launch_without_the_extra_prints_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "sky", None)  # what `import sky` sees without the extra
    result = CliRunner().invoke(app, ["launch", "--dryrun"])
    assert result.exit_code == 1
    assert INSTALL_HINT in result.output
    result = CliRunner().invoke(app, ["down"])
    assert result.exit_code == 1 and "art-agents[launch]" in result.output


def test_launch_config_is_strict():
    with pytest.raises(ValueError):
        LaunchConfig(clustr="x")  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        LaunchConfig(cluster="Bad_Name")


async def test_idle_exit_counts_requests_but_not_health_checks():
    async def asgi(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    tracker = ActivityTracker(asgi)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=tracker),
                                 base_url="http://t") as client:
        tracker.last_activity = time.monotonic() - 100
        await client.get("/health")
        assert tracker.idle_seconds() >= 100  # health checks are not use
        await client.post("/v1/chat/completions")
        assert tracker.idle_seconds() < 1

    stopped: list[float] = []
    busy = [True]
    task = asyncio.create_task(exit_when_idle(
        tracker, minutes=0.002, busy=lambda: busy[0], stop=lambda: stopped.append(1),
        poll_s=0.02))
    await asyncio.sleep(0.3)
    assert not stopped  # a training step running is not idleness
    busy[0] = False
    await asyncio.wait_for(task, 2)
    assert stopped == [1]
