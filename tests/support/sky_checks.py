"""SkyPilot checks of `art launch`'s task, run by tests/unit/test_launch.py inside `.venv-sky`.

SkyPilot pins click<=8.1.8, which conflicts with the training stack, so it lives in its own
client-only environment (as on a user's laptop; scripts/setup.sh --dev builds it). This script
imports the real `sky` there and exits non-zero on the first failed check.
"""

from __future__ import annotations

import sys

import yaml

from art_core.launch import LaunchConfig, build_task, task_config

KEY = "k" * 43

CONFIGS = [
    LaunchConfig(),
    LaunchConfig(cluster="gpu-8", accelerators="H100:8", infra="k8s", port=8080,
                 idle_minutes=10, down=True, use_spot=True, disk_size=512,
                 allow_base_models=["Qwen/*"], envs={"HF_TOKEN": "x"}),

]


def check_task(cfg: LaunchConfig) -> None:
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
    assert '--train-processes "$ART_TRAIN_PROCESSES"' in task.run
    assert task.envs["ART_TRAIN_PROCESSES"] == str(cfg.train_process_count()) == str(count)
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


def check_rejects() -> None:
    bad = task_config(LaunchConfig(), KEY)
    bad["resources"]["autostop"]["idle_minuets"] = 5  # a typo: SkyPilot's schema refuses it
    import sky

    try:
        sky.Task.from_yaml_config(bad)
    except Exception as e:  # noqa: BLE001 - any schema error, as long as it names the key
        assert "idle_minuets" in str(e), e
    else:
        raise AssertionError("SkyPilot accepted an unknown autostop key")
    try:
        task_config(LaunchConfig(), "")
    except ValueError as e:
        assert "API key" in str(e), e
    else:
        raise AssertionError("an empty API key was accepted")


if __name__ == "__main__":
    for cfg in CONFIGS:
        check_task(cfg)
    check_rejects()
    import sky

    print(f"sky {sky.__version__}: {len(CONFIGS)} tasks validated, bad task refused", file=sys.stdout)
