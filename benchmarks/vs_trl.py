"""A full RL step, ours against TRL's GRPOTrainer: the same work on the same machine, one run.

Each step of each system: `--groups` prompts x 8 completions of `--max-tokens` tokens (every
completion runs to the limit, `--exact-length`, so both do the same work), a deterministic
reward, one GRPO optimizer step on a LoRA adapter. Ours: rollouts through the gateway (vLLM),
then `model.train` (journal, gate, train, save, hot-swap); `ours` runs with the default
settings (on a CPU the policy is served as merged weights, `EngineConfig.serve_merged`),
`ours-lora` serves it as a vLLM runtime LoRA. TRL: `GRPOTrainer` with a peft LoRA,
generating with `model.generate` (its default) or, with `--systems trl-vllm`, with vLLM
colocated. Every (system, model, length) runs in its own subprocess, so peak RSS is its own
(sampled over the whole process tree: our vLLM server counts). The first `--warmup` steps are
not counted. Printed per system: median (min-max) of step wall time, generation time,
training time, trained and sampled tokens/s over the full step, peak RSS; then per
configuration the full-step throughput ratio ours/TRL. The last line is `ratio: X`: the
smallest per-configuration ratio of ours (of ours-lora if ours did not run); the goal,
1.5, holds when X >= 1.5. The line before it gives each system's smallest ratio.

Settings kept equal: base model, LoRA shape (r, alpha, dropout 0, target modules), prompts and
their order, group size 8, maximum completion length, temperature 1 with no top-p/top-k,
learning rate (constant schedule, AdamW betas 0.9/0.999, no weight decay, grad-norm clip 1),
loss CISPO with the importance weight capped at 5 (ours epsilon_high=4: cap 1+4; TRL
epsilon_high=5.0: cap 5.0), no KL term (ours kl_coef=0, TRL beta=0), rewards scaled by the
group std, gradient checkpointing, the trainers' precision (bf16 (frozen weights in bf16,
autocast) where the CPU multiplies bf16 natively, else float32: on an AVX2-only CPU torch's bf16
matmul runs at 0.8 GFLOP/s against 34 in float32; our sampler keeps its default,
`EngineConfig.dtype` "auto", which serves merged weights in float32 on a CPU, unless
`--precision` is given, which sets both systems' sampler and trainer), micro-batch size
(TRL: per_device_train_batch_size, with gradient accumulation to one optimizer step per
generation batch), torch threads (`--threads`).

Settings that differ, and why:
- Sampler: ours is vLLM (1 OpenMP thread, `EngineConfig.cpu_threads`, so that the gateway and
  the trainer keep a core) behind our gateway; TRL's default is `model.generate` in the trainer
  process on `--threads` threads. That difference is what is being compared.
- Exact length: ours sends `ignore_eos` to vLLM; TRL passes `min_new_tokens` to `generate`
  (`min_tokens` to vLLM in trl-vllm). Both produce exactly `--max-tokens` tokens.
- Loss normalisation: TRL's cispo divides by the batch's token count; ours weighs every
  trajectory equally. With equal-length completions the two coincide.
- Old logprobs: ours uses the sampler's (vLLM's) logprobs; TRL with num_iterations=1 uses the
  trainer's own (detached), so neither pays an extra forward pass.
- Zero-variance groups: ours drops them from the gradient (ARCHITECTURE invariant 7); TRL
  trains them with advantage 0. The reward below almost never ties a whole group.
- Work outside the step: ours also journals the groups, saves the adapter and loads it into
  vLLM every step (durability and serving the new policy); TRL keeps the adapter in memory
  (save_strategy "no"). This is part of our step's cost, counted in our training time.
- TRL's vLLM modes: "server" refuses a CPU trainer (its weight sync needs NCCL/CUDA:
  `VLLMClient.init_communicator` raises NotImplementedError for a non-CUDA device); "colocate"
  is what `--systems trl-vllm` tries (trl 1.16 also warns that vllm 0.32 is outside the
  versions it supports, 0.22-0.31). It is not in the default set because it was not verified
  on CPU; when it fails, its row says so.

    .venv/bin/python benchmarks/vs_trl.py [--models smollm2 tiny-qwen3] [--max-tokens 64 256]
        [--steps 3] [--warmup 1] [--systems trl ours ours-lora] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workers import (  # noqa: E402
    RESULT_TAG,
    StepRecord,
    TreeRSS,
    WorkerResult,
    run_subprocess,
)

GROUP_SIZE = 8
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."
PROMPTS = [
    "Describe the ocean.", "Why is the sky blue?", "What is a computer?", "Tell me about dogs.",
    "How do plants grow?", "What is music?", "Explain gravity.", "What is the internet?",
    "Describe a city at night.", "Why do we sleep?", "What is friendship?", "How does rain form?",
]
MODELS = ("smollm2", "tiny-qwen3")
SYSTEMS = ("trl", "trl-vllm", "ours", "ours-lora")
OURS = ("ours-lora", "ours")  # runtime LoRA; the defaults (merged weights on a CPU). Last: the ratio
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}  # --precision -> torch / vLLM dtype name
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def reward(text: str) -> float:
    """Share of short words (<= 4 characters): deterministic, cheap, and it differs between
    samples of a group even when every completion has the same number of tokens."""
    words = text.split()
    return sum(len(w) <= 4 for w in words) / len(words) if words else 0.0


def step_prompts(step: int, groups: int) -> list[str]:
    """The prompts of step `step`, identical for every system."""
    return [PROMPTS[(step * groups + g) % len(PROMPTS)] for g in range(groups)]


def messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]


def model_path(name: str) -> str:
    """A local directory both systems load: the embedded SmolLM2-135M-Instruct, or a tiny
    random Qwen3 (art_core.testing.tiny) cached under $ART_HOME."""
    from art_core.base_models import art_home, ensure_default_model

    if name == "smollm2":
        return str(ensure_default_model())
    if name.startswith("tiny-"):
        from art_core.testing.tiny import build_tiny_model

        arch = name.removeprefix("tiny-")
        return str(build_tiny_model(art_home() / "bench" / name, arch))  # type: ignore[arg-type]
    raise ValueError(f"unknown model {name!r}; use one of {MODELS}")


# ---- TRL ----------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace, use_vllm: bool) -> WorkerResult:
    """GRPOTrainer with a peft LoRA; phases timed with its public callback API and the reward
    function (called right after generation): generation = step begin -> reward computed,
    training = reward computed -> next step begin (loss, backward, optimizer, logging)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    result = WorkerResult("trl-vllm" if use_vllm else "trl", args.model, args.max_tokens)
    t_setup = time.perf_counter()
    path = model_path(args.model)
    total = args.warmup + args.steps
    rows = [{"prompt": messages(p)} for s in range(total) for p in step_prompts(s, args.groups)]
    batch = args.groups * GROUP_SIZE
    if batch % args.micro_batch:
        raise SystemExit(f"--micro-batch must divide {batch}")
    marks: dict[str, list[float]] = {"begin": [], "reward": [], "end": []}
    sampled: list[int] = []

    def timed_reward(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                     **_: Any) -> list[float]:
        sampled.append(sum(len(ids) for ids in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [reward(t) for t in texts]
        marks["reward"].append(time.perf_counter())
        return out

    class PhaseTimer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            marks["begin"].append(time.perf_counter())

        def on_train_end(self, *a: Any, **k: Any) -> None:
            marks["end"].append(time.perf_counter())

    if args.exact_length:
        gen_kwargs = {"min_tokens": args.max_tokens} if use_vllm else {
            "min_new_tokens": args.max_tokens}
    else:
        gen_kwargs = {}
    vllm_kwargs: dict[str, Any] = {}
    if use_vllm:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        vllm_kwargs = dict(use_vllm=True, vllm_mode="colocate",
                           vllm_max_model_length=args.max_tokens + 512)
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=args.precision == "bf16", seed=0,
            report_to="none",
            logging_steps=1, save_strategy="no", disable_tqdm=True,
            max_steps=total, learning_rate=args.learning_rate, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=batch // args.micro_batch,
            num_generations=GROUP_SIZE, max_completion_length=args.max_tokens,
            temperature=1.0, top_p=1.0, top_k=0, generation_kwargs=gen_kwargs or None,
            loss_type="cispo", epsilon_high=5.0, beta=0.0, scale_rewards="group",
            num_iterations=1, shuffle_dataset=False, gradient_checkpointing=args.checkpointing,
            model_init_kwargs={"dtype": DTYPES[args.precision]}, dataloader_num_workers=0,
            **vllm_kwargs,
        )
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                          target_modules=TARGET_MODULES, bias="none", task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=path, reward_funcs=[timed_reward], args=config,
                              train_dataset=Dataset.from_list(rows), peft_config=lora,
                              callbacks=[PhaseTimer()])
        result.setup_s = time.perf_counter() - t_setup
        trainer.train()
    edges = marks["begin"] + marks["end"]
    for i in range(args.warmup, total):
        begin, reward_at, nxt = marks["begin"][i], marks["reward"][i], edges[i + 1]
        result.steps.append(StepRecord(step_s=nxt - begin, gen_s=reward_at - begin,
                                       train_s=nxt - reward_at, sampled_tokens=sampled[i],
                                       trained_tokens=sampled[i]))  # TRL trains every token
    return result


# ---- ours ---------------------------------------------------------------------------------


async def run_ours(args: argparse.Namespace, lora: bool = False) -> WorkerResult:
    """LocalBackend: 8 rollouts per prompt through the gateway (all groups concurrently),
    then model.train. generation = the rollouts' wall time, training = model.train's.
    `lora`: the engine serves the policy as a runtime LoRA (serve_merged=False), not as the
    default does."""
    import torch

    from art_core import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
    from art_core.config import EngineConfig, LoraConfig, ModelConfig

    torch.set_num_threads(args.threads)
    result = WorkerResult("ours-lora" if lora else "ours", args.model, args.max_tokens)
    t_setup = time.perf_counter()
    path = model_path(args.model)
    extra: dict[str, Any] = {}  # no top_k: vLLM's default (off) matches TRL's top_k=0
    if args.exact_length:
        extra["ignore_eos"] = True
    config = TrainConfig(learning_rate=args.learning_rate, loss="cispo", epsilon_high=4.0,
                         kl_coef=0.0, scale_rewards=True, max_grad_norm=1.0, weight_decay=0.0,
                         micro_batch_size=args.micro_batch,
                         gradient_checkpointing=args.checkpointing,
                         bf16=args.precision == "bf16")
    with tempfile.TemporaryDirectory() as root:
        async with LocalBackend(root) as backend:
            model = TrainableModel(
                name="bench", project="bench", base_model=path,
                config=ModelConfig(
                    lora=LoraConfig(rank=args.rank, alpha=2 * args.rank, dropout=0.0,
                                    target_modules=TARGET_MODULES),
                    engine=EngineConfig(max_model_len=max(2048, args.max_tokens + 512),
                                        cpu_threads=args.engine_threads,
                                        dtype=(DTYPES[args.precision]
                                               if args.precision_set else "auto"),
                                        serve_merged=False if lora else None)))
            await model.register(backend)
            client = model.openai_client()
            result.setup_s = time.perf_counter() - t_setup

            async def one(prompt: str) -> tuple[Trajectory, int]:
                traj = Trajectory(messages=messages(prompt))
                r = await client.chat.completions.create(
                    model=model.name, messages=traj.messages, max_tokens=args.max_tokens,
                    temperature=1.0, top_p=1.0, extra_body=extra)
                traj.add_completion(r)
                traj.reward = reward(r.choices[0].message.content or "")
                return traj, r.usage.completion_tokens if r.usage else 0

            for step in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                done = await asyncio.gather(*[one(p) for p in step_prompts(step, args.groups)
                                              for _ in range(GROUP_SIZE)])
                groups = [TrajectoryGroup(trajectories=[t for t, _ in done[g:g + GROUP_SIZE]])
                          for g in range(0, len(done), GROUP_SIZE)]
                t1 = time.perf_counter()
                trained = await model.train(groups, config)
                t2 = time.perf_counter()
                if step >= args.warmup:
                    result.steps.append(StepRecord(
                        step_s=t2 - t0, gen_s=t1 - t0, train_s=t2 - t1,
                        sampled_tokens=sum(n for _, n in done),
                        trained_tokens=int(trained.metrics.get("trained_tokens", 0))))
    return result


# ---- the report ---------------------------------------------------------------------------

COLUMNS = [  # (header, key, format)
    ("step s", "step_s", "{:.2f}"), ("gen s", "gen_s", "{:.2f}"), ("train s", "train_s", "{:.2f}"),
    ("trained tok/s", "trained_tps", "{:.0f}"), ("sampled tok/s", "sampled_tps", "{:.0f}"),
]


def per_step(rec: dict[str, Any]) -> dict[str, float]:
    return {"step_s": rec["step_s"], "gen_s": rec["gen_s"], "train_s": rec["train_s"],
            "trained_tps": rec["trained_tokens"] / rec["step_s"],
            "sampled_tps": rec["sampled_tokens"] / rec["step_s"]}


def summarize(result: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """metric -> (median, min, max) over the counted steps."""
    rows = [per_step(r) for r in result["steps"]]
    return {k: (statistics.median(r[k] for r in rows), min(r[k] for r in rows),
                max(r[k] for r in rows)) for k in rows[0]} if rows else {}


def throughput(result: dict[str, Any]) -> float | None:
    """Full-step throughput: sampled tokens (generated and then trained) per second of step."""
    s = summarize(result)
    return s["sampled_tps"][0] if s else None


def format_report(results: list[dict[str, Any]]) -> list[str]:
    """The table, one ratio line per configuration and system of ours, then `ratio: X` last:
    the smallest per-configuration ratio to TRL of ours if it ran, else of ours-lora."""
    header = f"{'model':<11} {'len':>4} {'system':<11}" + "".join(
        f" {h:>19}" for h, _, _ in COLUMNS) + f" {'peak RSS GiB':>12}"
    lines = [header, "-" * len(header)]
    ratios: dict[str, list[float]] = {mine: [] for mine in OURS}
    configs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        configs.setdefault((r["model"], r["max_tokens"]), []).append(r)
    for (model, length), rows in configs.items():
        for r in rows:
            head = f"{model:<11} {length:>4} {r['system']:<11}"
            s = summarize(r)
            if r.get("error") or not s:
                lines.append(f"{head} failed: {r.get('error') or 'no steps counted'}")
                continue
            cells = "".join(
                f" {fmt.format(s[k][0]) + ' (' + fmt.format(s[k][1]) + '-' + fmt.format(s[k][2]) + ')':>19}"
                for _, k, fmt in COLUMNS)
            lines.append(f"{head}{cells} {r['peak_rss_gib']:>12.2f}")
        for mine in OURS:
            ours = next((throughput(r) for r in rows if r["system"] == mine), None)
            for peer in ("trl", "trl-vllm"):
                theirs = next((throughput(r) for r in rows if r["system"] == peer), None)
                if ours and theirs:
                    ratio = ours / theirs
                    if peer == "trl":
                        ratios[mine].append(ratio)
                    lines.append(f"{'':<11} {length:>4} {mine}/{peer}: full-step throughput "
                                 f"x{ratio:.2f}, step time x{1 / ratio:.2f}")
    ran = [mine for mine in OURS if ratios[mine]]
    if not ran:
        return [*lines, "ratio: n/a"]
    lines.append("smallest ratio to trl: " + ", ".join(
        f"{mine} {min(ratios[mine]):.2f}" for mine in ran) + f" (the last line is {ran[-1]})")
    return [*lines, f"ratio: {min(ratios[ran[-1]]):.2f}"]


# ---- orchestration ------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    system = args.worker
    with TreeRSS() as rss:
        try:
            if system.startswith("ours"):
                result = asyncio.run(run_ours(args, lora=system == "ours-lora"))
            else:
                result = run_trl(args, use_vllm=system == "trl-vllm")
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            result = WorkerResult(system, args.model, args.max_tokens,
                                  error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    result.peak_rss_gib = rss.gib
    print(RESULT_TAG + json.dumps(asdict(result)), flush=True)


def run_worker(args: argparse.Namespace, system: str, model: str, length: int
               ) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--model", model,
           "--length", str(length), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--groups", str(args.groups), "--micro-batch", str(args.micro_batch),
           "--threads", str(args.threads), "--engine-threads", str(args.engine_threads),
           "--learning-rate", str(args.learning_rate), "--rank", str(args.rank),
           "--precision", args.precision if args.precision_set else "auto"]
    cmd += [] if args.exact_length else ["--no-exact-length"]
    cmd += [] if args.checkpointing else ["--no-checkpointing"]
    result, seconds = run_subprocess(cmd, args, WorkerResult(system, model, length))
    print(f"  {system:<11} {model:<11} {length:>4}: {seconds:.0f} s"
          + (f"  ({result['error']})" if result.get("error") else ""), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--max-tokens", nargs="+", type=int, default=[64, 256],
                   help="maximum (with --exact-length: exact) completion lengths")
    p.add_argument("--systems", nargs="+", default=["trl", "ours", "ours-lora"],
                   choices=SYSTEMS)
    p.add_argument("--steps", type=int, default=3, help="counted steps per system")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not counted")
    p.add_argument("--groups", type=int, default=1, help="prompts per step (x 8 completions)")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of both trainers (and TRL's generate)")
    p.add_argument("--engine-threads", type=int, default=1,
                   help="OpenMP threads of our vLLM engine (EngineConfig.cpu_threads)")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    p.add_argument("--no-exact-length", dest="exact_length", action="store_false",
                   help="let completions stop at EOS (then the two systems' work differs)")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                   help="gradient checkpointing off in both trainers")
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="both systems, sampler and trainer: auto = bf16 where the CPU has "
                        "native bf16 (AVX512-BF16 or AMX), else fp32")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    p.add_argument("--quick", action="store_true",
                   help="smoke setting: tiny Qwen3, 16 tokens, 1 warm-up + 2 steps")
    p.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.precision_set = args.precision != "auto"  # else our engine keeps its own default
    if args.precision == "auto":
        from art_core.host import cpu_supports_bf16

        args.precision = "bf16" if cpu_supports_bf16() else "fp32"
    if args.worker:
        args.max_tokens = args.length
        worker(args)
        return
    if args.quick:
        args.models, args.max_tokens, args.steps, args.warmup = ["tiny-qwen3"], [16], 2, 1
    if args.steps < 1 or args.warmup < 0 or args.groups < 1:
        p.error("--steps must be >= 1, --warmup >= 0, --groups >= 1")
    print(f"{args.groups} prompt(s) x {GROUP_SIZE} completions per step, {args.warmup} warm-up "
          f"+ {args.steps} counted steps, threads {args.threads} (our engine "
          f"{args.engine_threads}), LoRA r={args.rank}, lr {args.learning_rate}, "
          f"{'exact' if args.exact_length else 'maximum'} lengths {args.max_tokens}, "
          f"micro-batch {args.micro_batch}, checkpointing {args.checkpointing}, "
          f"precision {args.precision}", flush=True)
    results = [run_worker(args, system, model, length)
               for model in args.models for length in args.max_tokens
               for system in args.systems]
    print()
    for line in format_report(results):
        print(line)


if __name__ == "__main__":
    main()
