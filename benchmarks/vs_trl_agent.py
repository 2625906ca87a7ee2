"""A multi-turn tool-calling RL step, ours against TRL's GRPOTrainer: the same agent task, one run.

The task (benchmarks/agent_task.py) is the demo's countries and `lookup_country` tool:
`--task single`, a lookup and an answer (<= 2 model calls); `--task multi` (default), two
lookups and an answer (<= 3 model calls). Each step: `--groups` questions x 8 episodes, one GRPO
step on a LoRA.

- trl: `GRPOTrainer(tools=[lookup_country], max_tool_calling_iterations=lookups)`, peft LoRA,
  generating with `model.generate` (its vLLM server mode needs NCCL); it runs the tool loop
  itself, token in and token out, tool results masked out of the loss.
- ours: a LangGraph StateGraph (model -> ToolNode -> model, as the demo's `build_agent`) through
  our gateway, made trainable by `TrajectoryRecorder`, `TrainableModel` + `LocalBackend`. Its
  first `lookups` turns are forced calls (`tool_choice="required"`, as the demo). `ours`: default
  `ModelConfig()`; `ours-lora` / `ours-merged`: `EngineConfig(serve_merged=False / True)`;
  `--cpu-threads N` sets `EngineConfig.cpu_threads` for all three.

Kept equal, as in vs_trl.py: base model, prompts and their order, group size 8, the tool schema
(transformers' `get_json_schema` of the function, which TRL renders; bound to the LangGraph model
as that dict), per-turn max tokens, temperature (the demo's 0.7) with top-p 1 and no top-k, the
turn cap, LoRA shape (our `LoraConfig()` defaults), learning rate, CISPO capped at 5 and no KL,
group-std scaling, grad clipping, micro-batch, gradient checkpointing (`--checkpointing`, off
by default: what our `TrainConfig.gradient_checkpointing="auto"` picks at this task's sizes,
1 x 8 and 4 x 8, a packed row of ~1,700 tokens; TRL gets the same setting), precision.
Differs: TRL has no `tool_choice`, so SmolLM2 calls the tool there only when it chooses to and
TRL's episodes may be shorter (see `calls/ep`: the work per step differs with it). TRL's
`max_completion_length` caps a whole episode: it is set to calls x max tokens + 64 per tool
result, and `max_new_tokens` caps each turn. Loss normalisation, zero-variance groups and the
work outside the step (journal, save, load the adapter) differ as vs_trl.py says.

One subprocess per system (vs_trl.py's pattern, peak RSS over the process tree). Printed per
system, median (min-max) over `--steps` steps after `--warmup`: step, rollout and train seconds,
model calls per episode, sampled tokens/s (over the full step), trained tokens per step, reward;
peak RSS; for ours also `swap s` (adapter save + load into vLLM, part of train s), `seq
tokens` (the training sequences' tokens, prompts included) and `fwd tokens` (what the forward
pass runs over: a group's shared prompt once, `TrainConfig.pack_shared_prefix`); 0 for TRL,
which does not say (it forwards each episode whole, as `seq tokens` counts). Last line: `ratio: X` = TRL's median step time / `ours`'s.

    .venv/bin/python benchmarks/vs_trl_agent.py [--task multi|single] [--steps 3] [--warmup 1]
        [--systems trl ours ours-lora ours-merged] [--cpu-threads N] [--quick]
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from art_langgraph import demo  # noqa: E402
from benchmarks import limits, vs_trl  # noqa: E402 - its settings and helpers: model_path, ...
from benchmarks.agent_task import (  # noqa: E402 - the task, shared with other benchmarks
    LOOKUPS,
    Task,
    build_agent,
    episode,
    lookup_country,
    score,
    step_tasks,
)
from benchmarks.workers import (  # noqa: E402
    RESULT_TAG,
    StepRecord,
    TreeRSS,
    WorkerResult,
    run_subprocess,
)

GROUP_SIZE = vs_trl.GROUP_SIZE
SYSTEMS = ("trl", "ours", "ours-lora", "ours-merged")
TOOL_RESULT_TOKENS = 64  # room per tool result in TRL's whole-episode max_completion_length


# ---- TRL ----------------------------------------------------------------------------------


def run_trl(args: argparse.Namespace) -> WorkerResult:
    """GRPOTrainer with tools and a peft LoRA; phases timed as in vs_trl.py: rollout = step
    begin -> reward computed (right after the tool loop), train = reward -> next step begin."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from art_core.config import LoraConfig as OurLora
    from art_langgraph.messages import to_openai_message

    torch.set_num_threads(args.threads)
    result, t_setup = WorkerResult("trl", "smollm2", args.max_tokens), time.perf_counter()
    path = vs_trl.model_path("smollm2")
    # The embedded model's template is art_core's chatml_tools.jinja (hermes layout), which TRL
    # does not know (add_response_schema would raise): its Qwen3 response template parses the
    # same layout, `<tool_call>{json}</tool_call>` after "<|im_start|>assistant\n".
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.response_template = qwen3_template
    total, lookups = args.warmup + args.steps, LOOKUPS[args.task]
    tasks = [t for s in range(total) for t in step_tasks(args.task, s, args.groups)]
    rows = [{"prompt": [to_openai_message(m) for m in demo.prompt(t)], "task_id": i}
            for i, t in enumerate(tasks)]
    batch = args.groups * GROUP_SIZE
    marks: dict[str, list[float]] = {"begin": [], "reward": [], "end": []}
    per_gen: list[dict[str, float]] = []  # one per generation batch (= optimizer step)
    sampled: list[float] = []  # model tokens per step (TRL's tool-masked completion length)

    def reward(prompts: list[Any], completions: list[Any], task_id: list[int], **_: Any
               ) -> list[float]:
        episodes = [episode(c) for c in completions]
        if args.verbose:  # what the model wrote, on the worker's stderr
            for c in completions:
                print("trl completion:", json.dumps(c)[:400], file=sys.stderr)
        out = [score(tasks[i], seen, answer)
               for i, (seen, answer, _) in zip(task_id, episodes, strict=True)]
        per_gen.append({"calls": statistics.mean(n for *_, n in episodes),
                        "reward": statistics.mean(out)})
        marks["reward"].append(time.perf_counter())
        return out

    class Phases(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            marks["begin"].append(time.perf_counter())

        def on_log(self, *a: Any, logs: dict[str, float] | None = None, **k: Any) -> None:
            if logs and "completions/mean_length" in logs:
                sampled.append(logs["completions/mean_length"] * batch)

        def on_train_end(self, *a: Any, **k: Any) -> None:
            marks["end"].append(time.perf_counter())

    ours_lora = OurLora()  # our default shape, given to peft
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out, use_cpu=True, bf16=args.precision == "bf16", seed=0,
            report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True,
            max_steps=total, learning_rate=args.learning_rate, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
            adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=batch // args.micro_batch, num_generations=GROUP_SIZE,
            max_completion_length=(lookups + 1) * args.max_tokens + lookups * TOOL_RESULT_TOKENS,
            generation_kwargs={"max_new_tokens": args.max_tokens},  # per turn
            max_tool_calling_iterations=lookups, temperature=args.temperature, top_p=1.0, top_k=0,
            loss_type="cispo", epsilon_high=5.0, beta=0.0, scale_rewards="group",
            num_iterations=1, shuffle_dataset=False,
            gradient_checkpointing=args.checkpointing == "on",
            model_init_kwargs={"dtype": vs_trl.DTYPES[args.precision]}, dataloader_num_workers=0,
        )
        lora = LoraConfig(r=ours_lora.rank, lora_alpha=ours_lora.alpha,
                          lora_dropout=ours_lora.dropout, target_modules=ours_lora.target_modules,
                          bias="none", task_type="CAUSAL_LM")
        trainer = GRPOTrainer(model=path, reward_funcs=[reward], args=config,
                              train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                              peft_config=lora, tools=[lookup_country], callbacks=[Phases()])
        result.setup_s = time.perf_counter() - t_setup
        trainer.train()
    edges = marks["begin"] + marks["end"]
    for i in range(args.warmup, total):
        begin, reward_at, nxt = marks["begin"][i], marks["reward"][i], edges[i + 1]
        n = int(sampled[i]) if i < len(sampled) else 0
        result.steps.append(AgentStep(step_s=nxt - begin, gen_s=reward_at - begin,
                                      train_s=nxt - reward_at, sampled_tokens=n,
                                      trained_tokens=n, **per_gen[i]))  # TRL trains every one
    return result


# ---- ours ---------------------------------------------------------------------------------


async def run_ours(args: argparse.Namespace, system: str) -> WorkerResult:
    """LocalBackend: every episode of the step concurrently through the gateway, recorded by
    TrajectoryRecorder, then model.train. rollout = the episodes' wall time, train = train's."""
    import torch

    from art_core import LocalBackend, TrainableModel, TrainConfig, TrajectoryGroup
    from art_core.config import EngineConfig, ModelConfig
    from art_langgraph.chat_model import init_chat_model
    from art_langgraph.messages import to_openai_message
    from art_langgraph.recorder import TrajectoryRecorder

    torch.set_num_threads(args.threads)
    result, t_setup = WorkerResult(system, "smollm2", args.max_tokens), time.perf_counter()
    engine: dict[str, Any] = {}  # `ours`: the defaults, which are what is being raced
    if system != "ours":
        engine["serve_merged"] = system == "ours-merged"
    if args.cpu_threads:
        engine["cpu_threads"] = args.cpu_threads
    if args.precision_set:  # an explicit --precision; else dtype "auto" picks as vs_trl.py does
        engine["dtype"] = vs_trl.DTYPES[args.precision]
    config = TrainConfig(learning_rate=args.learning_rate, loss="cispo", epsilon_high=4.0,
                         kl_coef=0.0, scale_rewards=True, max_grad_norm=1.0, weight_decay=0.0,
                         micro_batch_size=args.micro_batch,
                         gradient_checkpointing=args.checkpointing == "on",
                         bf16=args.precision == "bf16")
    lookups, path = LOOKUPS[args.task], vs_trl.model_path("smollm2")
    with tempfile.TemporaryDirectory() as root:
        async with LocalBackend(root) as backend:
            model = TrainableModel(name="agent", project="bench", base_model=path,
                                   config=ModelConfig(engine=EngineConfig(**engine)))
            await model.register(backend)
            graph = build_agent(init_chat_model(model, max_tokens=args.max_tokens,
                                                temperature=args.temperature, top_p=1.0), lookups)
            result.setup_s = time.perf_counter() - t_setup

            async def rollout(task: Task) -> Any:
                def reward(state: dict[str, Any]) -> float:
                    turns = [to_openai_message(m) for m in demo.this_question(state["messages"])]
                    return score(task, *episode(turns)[:2])

                recorder = TrajectoryRecorder(reward=reward)
                await graph.ainvoke({"messages": demo.prompt(task)},
                                    config={"callbacks": [recorder]})
                return await recorder.afinish()

            for step in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                tasks = step_tasks(args.task, step, args.groups)
                done = await asyncio.gather(*[rollout(t) for t in tasks for _ in range(GROUP_SIZE)])
                groups = [TrajectoryGroup(trajectories=list(done[g:g + GROUP_SIZE]))
                          for g in range(0, len(done), GROUP_SIZE)]
                t1 = time.perf_counter()
                trained = await model.train(groups, config)
                t2 = time.perf_counter()
                if step >= args.warmup:
                    result.steps.append(AgentStep(
                        step_s=t2 - t0, gen_s=t1 - t0, train_s=t2 - t1,
                        sampled_tokens=sum(len(turn.completion_token_ids)
                                           for t in done for turn in t.turns),
                        trained_tokens=int(trained.metrics.get("trained_tokens", 0)),
                        calls=statistics.mean(len(t.turns) for t in done),
                        reward=statistics.mean(float(t.reward or 0.0) for t in done),
                        tokens=float(trained.metrics.get("tokens", 0)),
                        forwarded=float(trained.metrics.get("forwarded_tokens", 0)),
                        swap_s=float(trained.metrics.get("swap_seconds", 0.0))))
    return result


# ---- records, report, orchestration -------------------------------------------------------


@dataclass
class AgentStep(StepRecord):
    calls: float = 0.0  # model calls per episode, mean over the step's episodes
    reward: float = 0.0
    tokens: float = 0.0  # tokens of the training sequences (prompts included)
    forwarded: float = 0.0  # tokens the forward pass ran over: shared prompts once (packing)
    swap_s: float = 0.0  # ours: adapter save + load into vLLM, inside train s


COLUMNS = [  # (header, key, format)
    ("step s", "step_s", "{:.2f}"), ("rollout s", "gen_s", "{:.2f}"),
    ("train s", "train_s", "{:.2f}"), ("swap s", "swap_s", "{:.2f}"),
    ("seq tokens", "tokens", "{:.0f}"), ("fwd tokens", "forwarded", "{:.0f}"),
    ("calls/ep", "calls", "{:.2f}"),
    ("sampled tok/s", "sampled_tps", "{:.0f}"), ("trained tok/step", "trained_tokens", "{:.0f}"),
    ("reward", "reward", "{:.2f}"),
]


def summarize(result: dict[str, Any]) -> dict[str, tuple[float, float, float]]:
    """metric -> (median, min, max) over the counted steps (vs_trl.py's per-step metrics and
    the agent's own)."""
    rows = [{**vs_trl.per_step(r), "calls": r["calls"], "reward": r["reward"],
             "trained_tokens": r["trained_tokens"], "tokens": r.get("tokens", 0.0),
             "forwarded": r.get("forwarded", 0.0),
             "rollout_tps": r["sampled_tokens"] / r["gen_s"] if r["gen_s"] else 0.0,
             "train_tps": (r.get("forwarded", 0.0) / (r["train_s"] - r.get("swap_s", 0.0))
                           if r["train_s"] > r.get("swap_s", 0.0) else 0.0), "swap_s": r.get("swap_s", 0.0)} for r in result["steps"]]
    return {k: (statistics.median(r[k] for r in rows), min(r[k] for r in rows),
                max(r[k] for r in rows)) for k in rows[0]} if rows else {}


def format_report(results: list[dict[str, Any]]) -> list[str]:
    header = f"{'system':<12}" + "".join(f" {h:>19}" for h, _, _ in COLUMNS) + " peak RSS GiB"
    lines, medians = [header, "-" * len(header)], {}
    for r in results:
        s = summarize(r)
        if r.get("error") or not s:
            lines.append(f"{r['system']:<12} failed: {r.get('error') or 'no steps counted'}")
            continue
        medians[r["system"]] = s
        cells = ["{} ({}-{})".format(*(fmt.format(v) for v in s[k])) for _, k, fmt in COLUMNS]
        lines.append(f"{r['system']:<12}" + "".join(f" {c:>19}" for c in cells)
                     + f" {r['peak_rss_gib']:>12.2f}")
    trl = medians.get("trl")
    for mine in [m for m in SYSTEMS[1:] if m in medians and trl]:
        ours = medians[mine]
        lines.append(f"trl/{mine}: step time x{trl['step_s'][0] / ours['step_s'][0]:.2f} "
                     f"(model calls per episode: trl {trl['calls'][0]:.2f}, "
                     f"{mine} {ours['calls'][0]:.2f})")
    if trl and "ours" in medians:
        return [*lines, f"ratio: {trl['step_s'][0] / medians['ours']['step_s'][0]:.2f}"]
    return [*lines, "ratio: n/a"]


def worker(args: argparse.Namespace) -> None:
    with TreeRSS() as rss:
        try:
            result = (run_trl(args) if args.worker == "trl"
                      else asyncio.run(run_ours(args, args.worker)))
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            result = WorkerResult(args.worker, "smollm2", args.max_tokens, error=error)
    result.peak_rss_gib = rss.gib
    print(RESULT_TAG + json.dumps(asdict(result)), flush=True)


def run_worker(args: argparse.Namespace, system: str) -> dict[str, Any]:
    """vs_trl.py's pattern: one subprocess per system, its result on a tagged stdout line."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system,
           "--settings", json.dumps(vars(args))]
    result, seconds = run_subprocess(
        cmd, args, WorkerResult(system, "smollm2", args.max_tokens))
    print(f"  {system:<12}: {seconds:.0f} s (set-up {result['setup_s']:.0f} s)"
          + (f"  ({result['error']})" if result.get("error") else ""), flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=list(LOOKUPS), default="multi",
                   help="single: 1 lookup + answer; multi: 2 lookups + a comparison answer")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=None,
                   help="default: all four (--quick: trl ours)")
    p.add_argument("--steps", type=int, default=3, help="counted steps per system")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not counted")
    p.add_argument("--groups", type=int, default=1, help="questions per step (x 8 episodes)")
    p.add_argument("--max-tokens", type=int, default=demo.MAX_TOKENS,
                   help="maximum tokens per model call (turn)")
    p.add_argument("--temperature", type=float, default=demo.TEMPERATURE)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward")
    p.add_argument("--checkpointing", choices=["on", "off"], default="off",
                   help="gradient checkpointing in both trainers (off: what ours' 'auto' "
                        "picks at this task's sizes)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of both trainers (and TRL's generate)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="EngineConfig.cpu_threads for our systems (default: its default)")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="both systems: auto = bf16 where the CPU has native bf16, else fp32")
    p.add_argument("--timeout", type=float, default=2400, help="seconds per worker")
    p.add_argument("--quick", action="store_true",
                   help="smoke setting: 0 warm-up + 1 step, systems trl and ours")
    p.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        settings = {**json.loads(args.settings), "worker": args.worker}
        worker(argparse.Namespace(**settings))
        return
    args.precision_set = args.precision != "auto"
    if args.precision == "auto":
        from art_core.host import cpu_supports_bf16

        args.precision = "bf16" if cpu_supports_bf16() else "fp32"
    if args.quick:
        args.steps, args.warmup = 1, 0
        args.systems = args.systems or ["trl", "ours"]
    args.systems = args.systems or list(SYSTEMS)
    if min(args.steps, args.groups, args.max_tokens, args.warmup + 1) < 1:
        p.error("--steps, --groups and --max-tokens must be >= 1, --warmup >= 0")
    if (args.groups * GROUP_SIZE) % args.micro_batch:
        p.error(f"--micro-batch must divide {args.groups * GROUP_SIZE}")
    print(f"task {args.task}: at most {LOOKUPS[args.task] + 1} model calls of {args.max_tokens} "
          f"tokens, temperature {args.temperature}; {args.groups} x {GROUP_SIZE} episodes per "
          f"step, {args.warmup} warm-up + {args.steps} steps; threads {args.threads}, engine "
          f"threads {args.cpu_threads or 'default'}, lr {args.learning_rate}, micro-batch "
          f"{args.micro_batch}, checkpointing {args.checkpointing}, precision {args.precision}", flush=True)
    results = [run_worker(args, system) for system in args.systems]
    print()
    lines = format_report(results)
    lines[-1:-1] = limit_lines(args, results)  # `ratio: X` stays last
    for line in lines:
        print(line)


def limit_lines(args: argparse.Namespace, results: list[dict[str, Any]]) -> list[str]:
    """Where each of our systems' phases stands against this machine's limits (limits.py):
    training over forwarded tokens, decoding over the rollout's wall time (which also holds
    prefills, tool calls and the gateway, so it is a lower bound of the decode rate)."""
    ours = [r for r in results if r["system"].startswith("ours") and r["steps"]]
    if not ours:
        return []
    from art_core.config import EngineConfig
    from art_core.host import cpu_supports_bf16
    from art_core.inference.vllm_args import served_dtype

    dtype = "bfloat16" if cpu_supports_bf16() else "float32"  # the trainer's
    engine = EngineConfig(dtype=vs_trl.DTYPES[args.precision] if args.precision_set else "auto")
    served = "float32" if served_dtype(engine, cuda=False) == "float32" else dtype
    width = 4 if served == "float32" else 2
    linear, total = limits.model_counts(vs_trl.model_path("smollm2"))
    gemm_n = limits.gemm_flops(args.threads, dtype)
    gemm_1 = limits.gemm_flops(1, served)
    bw = limits.bandwidth()
    engine_threads = args.cpu_threads or engine.cpu_threads
    train_max = limits.train_limit(gemm_n, linear)
    decode_max = limits.decode_limit(args.groups * GROUP_SIZE, bw, gemm_1, engine_threads,
                                     width, total, linear)
    lines = ["", f"limits here: {dtype} GEMM {gemm_n / 1e12:.2f} TFLOP/s on {args.threads} "
             f"threads (the trainer), {served} {gemm_1 / 1e12:.2f} on 1 (the engine), copy "
             f"bandwidth {bw / 1e9:.1f} GB/s; train <= {train_max:.0f} forwarded tok/s, "
             f"decode <= {decode_max:.0f} tok/s ({args.groups * GROUP_SIZE} in flight, "
             f"{engine_threads} engine thread(s), {served} weights)"]
    for r in ours:
        m = summarize(r)
        train_tps, decode_tps = m["train_tps"][0], m["rollout_tps"][0]
        lines.append(f"{r['system']:<12} train {train_tps:.0f} forwarded tok/s "
                     f"({train_tps / train_max:.0%} of the limit; train s less swap s), "
                     f"rollout {decode_tps:.0f} sampled tok/s ({decode_tps / decode_max:.0%})")
    return lines


if __name__ == "__main__":
    main()
