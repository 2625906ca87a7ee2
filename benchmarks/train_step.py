"""Training throughput on a fixed batch of SmolLM2 trajectories.

Prints trained tokens/s, seconds per step and peak memory of the trainer (in-process, no vLLM),
then, with --swap, the time from the end of the optimizer step until the new adapter serves
requests through a real LocalBackend (save + vLLM load + gate reopen).

    .venv/bin/python benchmarks/train_step.py [--batch 8] [--completion-tokens 200] [--steps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import tempfile
import time

from art_core import TrainConfig, Trajectory, TrajectoryGroup
from art_core.base_models import ensure_default_model
from art_core.config import LoraConfig
from art_core.trajectory import SampledTurn


def synthetic_groups(tokenizer, batch: int, completion_tokens: int, seed: int = 0
                     ) -> list[TrajectoryGroup]:
    """Groups of 2 with distinct rewards: every trajectory is trained (no zero variance)."""
    rng = random.Random(seed)
    vocab = list(range(200, 40000))
    groups = []
    for g in range(batch // 2):
        trajs = []
        for k in range(2):
            msgs = [{"role": "user", "content": f"Question number {g}: tell me a story."}]
            prompt = tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"]
            completion = [rng.choice(vocab) for _ in range(completion_tokens)]
            trajs.append(Trajectory(
                messages=[*msgs, {"role": "assistant", "content": "..."}], reward=float(k),
                turns=[SampledTurn(message_index=1, prompt_token_ids=list(prompt),
                                   completion_token_ids=completion,
                                   logprobs=[-8.0] * completion_tokens)]))
        groups.append(TrajectoryGroup(trajectories=trajs))
    return groups


def bench_trainer(args: argparse.Namespace) -> None:
    import torch

    from art_core.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    path = str(ensure_default_model())
    trainer = Trainer(path, LoraConfig())
    groups = synthetic_groups(trainer.tokenizer, args.batch, args.completion_tokens)
    config = TrainConfig(micro_batch_size=args.micro_batch,
                         gradient_checkpointing=not args.no_checkpointing,
                         bf16=None if not args.fp32 else False)
    print(f"SmolLM2-135M, LoRA r=8 all projections, batch {args.batch} x "
          f"{args.completion_tokens} completion tokens, micro-batch {args.micro_batch}, "
          f"threads {torch.get_num_threads()}, bf16 {trainer.bf16_capable and not args.fp32}")
    rates = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        m = trainer.step(groups, config)
        dt = time.perf_counter() - t0
        rates.append(m["trained_tokens"] / dt)
        print(f"step {step}: {dt:.2f} s, {m['trained_tokens']:.0f} trained tokens "
              f"({m['tokens']:.0f} in sequences), {rates[-1]:.0f} trained tok/s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    steady = rates[1:] or rates
    print(f"trained tokens/s: {sum(steady) / len(steady):.0f} (steps after the first)")
    print(f"peak RSS of the trainer process: {peak:.2f} GiB")


async def bench_swap(args: argparse.Namespace) -> None:
    from art_core import LocalBackend, TrainableModel

    with tempfile.TemporaryDirectory() as root:
        async with LocalBackend(root) as backend:
            model = TrainableModel(name="bench", project="bench")
            await model.register(backend)
            trainer = backend._trainer(model)
            groups = synthetic_groups(trainer.tokenizer, 4, 32)
            client = model.openai_client()
            for _ in range(args.steps):
                result = await model.train(groups)
                t0 = time.perf_counter()
                r = await client.chat.completions.create(
                    model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
                first = time.perf_counter() - t0
                m = result.metrics
                print(f"step {result.step}: save {m['save_seconds']:.3f} s + load into vLLM and "
                      f"reopen {m['publish_seconds']:.3f} s = {m['swap_seconds']:.3f} s from "
                      f"optimizer step to serving; first request on {r.model}: {first:.3f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--completion-tokens", type=int, default=200)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--fp32", action="store_true")
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--swap", action="store_true", help="also measure the adapter hot-swap")
    args = p.parse_args()
    bench_trainer(args)
    if args.swap:
        asyncio.run(bench_swap(args))


if __name__ == "__main__":
    main()
