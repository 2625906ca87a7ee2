"""EngineConfig's tensor/data-parallel sizes reach vLLM's own engine arguments (parsed by vLLM's
own server argument parser, no engine started), and sizes that cannot fit the host are a clear
error before anything starts."""

from __future__ import annotations

import pytest

from art_core.config import EngineConfig
from art_core.inference.engine import EngineError, VLLMEngine, check_parallel_sizes


def vllm_engine_args(argv: list[str]):
    """What vLLM's server makes of our command line: its parser, then its EngineArgs."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    i = argv.index("vllm.entrypoints.openai.api_server")
    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv[i + 1:]))


@pytest.mark.parametrize(("tp", "dp"), [(1, 1), (2, 1), (1, 4), (2, 2)])
def test_parallel_sizes_reach_vllm_engine_args(tiny_models, tp, dp):
    config = EngineConfig(tensor_parallel_size=tp, data_parallel_size=dp)
    engine = VLLMEngine(str(tiny_models["llama"]), served_name="m", config=config, cuda=True)
    args = vllm_engine_args(engine.command())
    assert args.tensor_parallel_size == tp
    assert args.data_parallel_size == dp
    assert args.enable_lora and args.model == str(tiny_models["llama"])


@pytest.mark.parametrize(("tp", "dp", "gpus", "error"), [
    (2, 1, 1, "needs 2 GPUs, but 1 are visible"),
    (2, 2, 3, "needs 4 GPUs, but 3 are visible"),
    (1, 8, 0, "needs 8 GPUs, but 0 are visible"),
    (1, 1, 0, None),
    (2, 2, 4, None),
    (4, 2, 8, None),
])
def test_sizes_are_checked_against_the_gpu_count(tp, dp, gpus, error):
    config = EngineConfig(tensor_parallel_size=tp, data_parallel_size=dp)
    if error is None:
        check_parallel_sizes(config, cuda=True, device_count=gpus)
    else:
        with pytest.raises(EngineError, match=error):
            check_parallel_sizes(config, cuda=True, device_count=gpus)


def test_parallel_sizes_on_a_cpu_host_fail_before_vllm_starts(tiny_models, tmp_path):
    config = EngineConfig(tensor_parallel_size=2)
    engine = VLLMEngine(str(tiny_models["llama"]), served_name="m", config=config, cuda=False,
                        log_path=tmp_path / "vllm.log")
    with pytest.raises(EngineError, match="needs 2 CUDA GPUs"):
        engine.start()
    assert engine._proc is None and engine._watcher is None  # nothing was spawned
    assert not (tmp_path / "vllm.log").exists()


def test_sizes_are_validated_as_config():
    with pytest.raises(ValueError):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError):
        EngineConfig(data_parallel_sizes=2)  # type: ignore[call-arg]  # a typo is an error


@pytest.mark.parametrize(("dtype", "cuda", "cpu_bf16", "merged", "served"), [
    ("auto", False, False, False, "float32"),  # AVX2-only CPU: emulated bf16 decodes ~2x slower
    ("auto", False, True, False, "auto"),      # AVX512-BF16 / AMX, runtime LoRA: vLLM's bf16
    ("auto", False, True, None, "auto"),       # merged on a CPU: bf16, rounded stochastically
    ("auto", True, False, None, "auto"),       # a GPU: vLLM picks
    ("auto", True, True, True, "auto"),        # merged on a GPU: vLLM picks
    ("bfloat16", False, True, None, "bfloat16"),  # an explicit choice is kept
    ("float32", True, True, False, "float32"),
])
def test_auto_dtype_is_float32_on_a_cpu_without_bf16(
        tiny_models, monkeypatch, dtype, cuda, cpu_bf16, merged, served):
    from art_core.inference import vllm_args

    monkeypatch.setattr(vllm_args, "cpu_supports_bf16", lambda: cpu_bf16)
    engine = VLLMEngine(str(tiny_models["llama"]), served_name="m",
                        config=EngineConfig(dtype=dtype, serve_merged=merged), cuda=cuda)
    assert engine.dtype == served
    assert vllm_engine_args(engine.command()).dtype == served


@pytest.mark.parametrize(("cuda", "config", "block_size", "max_num_seqs"), [
    (False, EngineConfig(), 32, 64),                      # CPU: small blocks for prefix hits
    (False, EngineConfig(cpu_block_size=128, max_num_seqs=16), 128, 16),
    (True, EngineConfig(cpu_block_size=64), None, 64),    # CUDA: vLLM's own block size
])
def test_block_size_and_batch_reach_vllm_engine_args(tiny_models, cuda, config, block_size,
                                                     max_num_seqs):
    engine = VLLMEngine(str(tiny_models["llama"]), served_name="m", config=config, cuda=cuda)
    args = vllm_engine_args(engine.command())
    assert args.block_size == block_size
    assert args.max_num_seqs == max_num_seqs


@pytest.mark.parametrize("size", [0, 16, 48])
def test_a_cpu_block_size_vllm_cannot_take_is_refused(size):
    with pytest.raises(ValueError, match="cpu_block_size"):
        EngineConfig(cpu_block_size=size)
