"""Where our RL step's time goes, phase by phase, next to what this machine can do.

One step = 8 rollouts per prompt through the gateway, then `model.train` (LocalBackend). Phases:

  rollout: engine     vLLM's own time (its /metrics e2e latency, mean per request)
  rollout: gateway    the gateway's time around it (its art_latency_s minus vLLM's)
  rollout: client     the rest of the rollouts' wall time (openai client, recorder, reward)
  ledger             journaling the groups and the history row (LocalBackend steps 1 and 7)
  tokenization       advantages, sequences from the sampled ids, weights, collation
  forward            model body, lm head logprobs (chunked), loss: per micro-batch
  backward           loss.backward (recomputing checkpointed layers) and the grad-norm clip
  optimizer          AdamW step
  save               adapter (safetensors, atomic rename) and optimizer moments
  adapter load       vLLM's worker merges W + BA and reloads it in place, the alias flips
                     (publish). With --lora: vLLM loads the new adapter as a runtime LoRA
  policy check       the served-policy check before the step is published: the probe's prompt
                     logprobs and one next token asked of vLLM, compared with the trainer's
  gate               closing the gate, draining, reopening, loggers: the rest of train()

The rollout split is by mean per-request latency (requests run concurrently, so the wall time
is shared out in those proportions). Trainer phases are timed by wrapping this repository's own
functions in this process only, plus torch's public optimizer hooks: no library is patched.

Limits, measured here: matmul FLOP/s in the default precision (bf16 where the CPU has it
natively, else float32) (a 2048^3 GEMM, 1 thread and --threads) and memory
bandwidth (a 256 MiB copy, 1 thread), with the nominal AMX peak (1024 bf16 FLOP/cycle/core)
for reference. From them: training tokens/s <= GEMM FLOP/s / (k x 2 x linear params) per token
forwarded (a group's shared prompt counts once, `TrainConfig.pack_shared_prefix`; k = 3 with gradient checkpointing: forward, recompute, input gradients; LoRA's
own gradients are negligible), and decoding tokens/s <= min(batch x bandwidth / weight bytes,
GEMM FLOP/s / (2 x linear params)) on the engine's threads.

    .venv/bin/python benchmarks/step_profile.py [--model smollm2] [--max-tokens 64]
        [--steps 3] [--lora] [--no-engine]

`--no-engine` profiles only the trainer-side phases on synthetic groups (no vLLM is started).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from limits import (  # noqa: E402
    bandwidth,
    decode_limit,
    gemm_flops,
    model_counts,
    nominal_amx_flops,
    train_limit,
)
from vs_trl import (  # noqa: E402  (a sibling benchmark script, not a package)
    GROUP_SIZE,
    TARGET_MODULES,
    messages,
    model_path,
    reward,
    step_prompts,
)

PHASES = ["rollout: engine", "rollout: gateway", "rollout: client", "ledger", "tokenization",
          "forward", "backward", "optimizer", "save", "adapter load", "policy check", "gate"]


class Timeline:
    """Seconds per phase, from wrapped functions and marks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.last_mark: float | None = None

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            self.close_backward()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[phase] += time.perf_counter() - t0
        setattr(owner, attr, timed)

    # backward has no function of ours around it: it runs from the end of grpo_loss until the
    # next thing we see (next micro-batch's collation or the optimizer step)
    def open_backward(self) -> None:
        self.last_mark = time.perf_counter()

    def close_backward(self) -> None:
        if self.last_mark is not None:
            self.seconds["backward"] += time.perf_counter() - self.last_mark
            self.last_mark = None


def instrument(timeline: Timeline) -> None:
    import torch.optim.optimizer as topt

    from art_core.storage import ModelDir
    from art_core.train import advantages as A
    from art_core.train import batch as B
    from art_core.train import trainer as T

    timeline.wrap(A, "compute_advantages", "tokenization")
    for name in ("build_all_sequences", "with_token_weights", "collate", "shift_for_next_token"):
        timeline.wrap(B, name, "tokenization")
    timeline.wrap(ModelDir, "journal_groups", "ledger")
    timeline.wrap(ModelDir, "append_history", "ledger")
    timeline.wrap(T.Trainer, "save_adapter", "save")
    timeline.wrap(T.Trainer, "save_optimizer", "save")
    timeline.wrap(T.Trainer, "_token_logprobs", "forward")
    loss_fn = T.grpo_loss

    def grpo_loss(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = loss_fn(*a, **k)
        timeline.seconds["forward"] += time.perf_counter() - t0
        timeline.open_backward()
        return out
    T.grpo_loss = grpo_loss
    opt_start: list[float] = []

    def pre(*_: Any) -> None:
        timeline.close_backward()
        opt_start.append(time.perf_counter())

    def post(*_: Any) -> None:
        timeline.seconds["optimizer"] += time.perf_counter() - opt_start.pop()
    topt.register_optimizer_step_pre_hook(pre)
    topt.register_optimizer_step_post_hook(post)


# ---- the step ------------------------------------------------------------------------------


async def metrics_e2e(client: Any, url: str) -> tuple[float, float]:
    """(sum, count) of vLLM's e2e request latency histogram."""
    text = (await client.get(url)).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:e2e_request_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:e2e_request_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def profile_with_engine(args: argparse.Namespace, timeline: Timeline
                              ) -> tuple[list[dict[str, float]], dict[str, float]]:
    import httpx

    from art_core import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
    from art_core.config import EngineConfig, LoraConfig, ModelConfig

    path = model_path(args.model)
    config = TrainConfig(learning_rate=1e-4, micro_batch_size=args.micro_batch)
    steps: list[dict[str, float]] = []
    tokens: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory() as root:
        async with LocalBackend(root) as backend, httpx.AsyncClient(timeout=60) as http:
            model = TrainableModel(
                name="profile", project="bench", base_model=path,
                config=ModelConfig(lora=LoraConfig(target_modules=TARGET_MODULES),
                                   engine=EngineConfig(max_model_len=2048,
                                                       cpu_threads=args.engine_threads,
                                                       serve_merged=False if args.lora else None)))
            await model.register(backend)
            engine = backend.gateway.models[model.name].engine
            client = model.openai_client()

            async def one(prompt: str) -> tuple[Trajectory, float, float, int]:
                traj = Trajectory(messages=messages(prompt))
                t0 = time.perf_counter()
                r = await client.chat.completions.create(
                    model=model.name, messages=traj.messages, max_tokens=args.max_tokens,
                    temperature=1.0, extra_body={"ignore_eos": True})
                latency = time.perf_counter() - t0
                traj.add_completion(r)
                traj.reward = reward(r.choices[0].message.content or "")
                gw = float((r.model_extra or {}).get("art_latency_s") or latency)
                return traj, latency, gw, r.usage.completion_tokens if r.usage else 0

            for step in range(args.warmup + args.steps):
                timeline.seconds.clear()
                s0, c0 = await metrics_e2e(http, engine.base_url + "/metrics")
                t0 = time.perf_counter()
                done = await asyncio.gather(*[one(p) for p in step_prompts(step, args.groups)
                                              for _ in range(GROUP_SIZE)])
                wall = time.perf_counter() - t0
                s1, c1 = await metrics_e2e(http, engine.base_url + "/metrics")
                groups = [TrajectoryGroup(trajectories=[d[0] for d in done[g:g + GROUP_SIZE]])
                          for g in range(0, len(done), GROUP_SIZE)]
                t1 = time.perf_counter()
                result = await model.train(groups, config)
                train_wall = time.perf_counter() - t1
                client_mean = statistics.mean(d[1] for d in done)
                gw_mean = statistics.mean(d[2] for d in done)
                vllm_mean = (s1 - s0) / max(c1 - c0, 1) if c1 > c0 else gw_mean
                share = wall / client_mean
                row = dict(timeline.seconds)
                row["rollout: engine"] = vllm_mean * share
                row["rollout: gateway"] = max(gw_mean - vllm_mean, 0.0) * share
                row["rollout: client"] = max(wall - row["rollout: engine"]
                                             - row["rollout: gateway"], 0.0)
                check = result.metrics.get("policy_check_seconds", 0.0)
                row["adapter load"] = max(result.metrics.get("publish_seconds", 0.0) - check, 0.0)
                row["policy check"] = check
                row["gate"] = max(train_wall - sum(row.get(p, 0.0) for p in PHASES[3:11]), 0.0)
                row["_wall"] = wall + train_wall
                if step >= args.warmup:
                    steps.append(row)
                    tokens["sampled"] += sum(d[3] for d in done)
                    tokens["trained"] += result.metrics.get("trained_tokens", 0.0)
                    tokens["sequence"] += result.metrics.get("forwarded_tokens", sum(
                        len(t.turns[0].prompt_token_ids) + len(t.turns[0].completion_token_ids)
                        for g in groups for t in g.trajectories))
                    tokens["rollout_s"] += wall
    return steps, tokens


def profile_without_engine(args: argparse.Namespace, timeline: Timeline
                           ) -> tuple[list[dict[str, float]], dict[str, float]]:
    """The trainer half as LocalBackend runs it (journal, step, save), on synthetic groups."""
    from art_core import TrainConfig, Trajectory, TrajectoryGroup
    from art_core.config import LoraConfig
    from art_core.storage import ModelDir
    from art_core.train.trainer import Trainer
    from art_core.trajectory import SampledTurn

    trainer = Trainer(model_path(args.model), LoraConfig(target_modules=TARGET_MODULES))
    tok, rng = trainer.tokenizer, random.Random(0)
    groups = []
    for prompt in step_prompts(0, args.groups):
        prompt_ids = tok.apply_chat_template(messages(prompt), add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
        groups.append(TrajectoryGroup(trajectories=[Trajectory(
            messages=[*messages(prompt), {"role": "assistant", "content": "..."}], reward=k % 3,
            turns=[SampledTurn(message_index=2, prompt_token_ids=list(prompt_ids),
                               completion_token_ids=[rng.randrange(100, len(tok) - 1)
                                                     for _ in range(args.max_tokens)],
                               logprobs=[-2.0] * args.max_tokens)])
            for k in range(GROUP_SIZE)]))
    config = TrainConfig(learning_rate=1e-4, micro_batch_size=args.micro_batch)
    steps: list[dict[str, float]] = []
    tokens: dict[str, float] = defaultdict(float)
    with tempfile.TemporaryDirectory() as root:
        md = ModelDir(root, "bench", "profile")
        for step in range(1, args.warmup + args.steps + 1):
            timeline.seconds.clear()
            t0 = time.perf_counter()
            md.journal_groups(step, groups)
            m = trainer.step(groups, config)
            tmp = md.temp_checkpoint(step)
            trainer.save_adapter(tmp)
            md.commit_checkpoint(tmp, step)
            trainer.save_optimizer(md.optimizer, checkpoint=step)
            md.append_history({"step": step, **m})
            row = dict(timeline.seconds)
            row["_wall"] = time.perf_counter() - t0
            if step > args.warmup:
                steps.append(row)
                tokens["trained"] += m["trained_tokens"]
                tokens["sequence"] += m.get("forwarded_tokens", m.get("tokens", 0))
    return steps, tokens


def report(args: argparse.Namespace, steps: list[dict[str, float]], tokens: dict[str, float]
           ) -> None:
    wall = statistics.median(s["_wall"] for s in steps)
    print(f"\nphase profile, median of {len(steps)} step(s); step wall {wall:.2f} s")
    print(f"{'phase':<18} {'seconds':>8} {'share':>7}")
    accounted = 0.0
    for phase in PHASES:
        vals = [s.get(phase, 0.0) for s in steps]
        if not any(vals):
            continue
        med = statistics.median(vals)
        accounted += med
        print(f"{phase:<18} {med:>8.3f} {med / wall:>6.1%}")
    print(f"{'(unaccounted)':<18} {max(wall - accounted, 0):>8.3f} "
          f"{max(wall - accounted, 0) / wall:>6.1%}")

    linear, total = model_counts(model_path(args.model))
    from art_core.host import cpu_supports_bf16

    # the precision the trainer and the engine pick here by default (bf16 only where native)
    dtype, width = ("bfloat16", 2) if cpu_supports_bf16() else ("float32", 4)
    peak_1, peak_n = gemm_flops(1, dtype), gemm_flops(args.threads, dtype)
    bw = bandwidth()
    nominal = nominal_amx_flops(args.threads)
    n = len(steps)
    fwd_bwd = statistics.median(s.get("forward", 0) + s.get("backward", 0) for s in steps)
    k = 3  # forward + recompute (gradient checkpointing) + input gradients
    seq_tps = tokens["sequence"] / n / fwd_bwd if fwd_bwd else 0.0
    seq_limit = train_limit(peak_n, linear, k)
    print(f"\nlimits on this machine ({args.threads} threads for training, "
          f"{args.engine_threads} for the engine)")
    print(f"  {dtype} GEMM: {peak_1 / 1e12:.3f} TFLOP/s on 1 thread, {peak_n / 1e12:.3f} on "
          f"{args.threads}" + (f"; nominal AMX peak {nominal / 1e12:.1f}" if nominal else ""))
    print(f"  memory bandwidth (1-thread copy): {bw / 1e9:.1f} GB/s")
    print(f"  model: {linear / 1e6:.0f} M parameters in linear layers, {total / 1e6:.0f} M in all")
    print(f"  forward+backward: {seq_tps:.0f} forwarded tok/s reached, limit {seq_limit:.0f} "
          f"({seq_tps / seq_limit:.1%} of the GEMM peak; {k} x 2 x {linear / 1e6:.0f} M "
          f"FLOP per token)")
    if tokens.get("rollout_s"):
        batch = args.groups * GROUP_SIZE
        limit = decode_limit(batch, bw, peak_1, args.engine_threads, width, total, linear)
        reached = tokens["sampled"] / tokens["rollout_s"]
        print(f"  decoding ({batch} in flight): {reached:.0f} sampled tok/s reached, limit "
              f"{limit:.0f} ({reached / limit:.1%}; weights "
              f"{width * total / 1e6:.0f} MB {dtype} read once per engine step, or 2 x {linear / 1e6:.0f} M FLOP per token)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny-qwen3"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--lora", action="store_true",
                   help="serve a runtime LoRA (EngineConfig.serve_merged=False), not the default")
    p.add_argument("--no-engine", action="store_true",
                   help="trainer-side phases only, synthetic groups, no vLLM")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    timeline = Timeline()
    instrument(timeline)
    if args.no_engine:
        steps, tokens = profile_without_engine(args, timeline)
    else:
        steps, tokens = asyncio.run(profile_with_engine(args, timeline))
    report(args, steps, tokens)


if __name__ == "__main__":
    main()
