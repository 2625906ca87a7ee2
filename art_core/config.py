"""Typed configuration. Every field says what it does and why its default is what it is.

Unknown keys are errors (`extra="forbid"`), never silently ignored (ARCHITECTURE invariant 5).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Strict):
    """Shape of the LoRA adapter. Fixed when step 0 is created: it cannot change between steps."""

    rank: int = Field(8, ge=1, le=256, description=(
        "LoRA rank. RL carries little information per step, so a small rank matches full "
        "fine-tuning (Schulman et al., 'LoRA Without Regret', 2025); 8 keeps CPU steps fast."))
    alpha: int = Field(16, ge=1, description="LoRA alpha; alpha = 2 x rank is the common default.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description=(
        "Dropout makes the trainer's logprobs differ from the sampler's; off for RL."))
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                 "gate_proj", "up_proj", "down_proj"],
        description="All attention and MLP projections: 'LoRA Without Regret' finds MLP layers "
        "matter most; names fit Llama and Qwen.")


class EngineConfig(_Strict):
    """vLLM settings. Defaults work on a 2-core CPU host and on a CUDA host."""

    max_model_len: int = Field(4096, ge=128, description=(
        "Context length served. 4096 fits multi-turn agent rollouts of small models and keeps "
        "the CPU KV cache (1 GiB by default) from being the limit."))
    max_num_seqs: int = Field(64, ge=1, description=(
        "Concurrent sequences per engine step. On a CPU decoding is bound by reading the "
        "weights once per engine step, so a larger batch is nearly free per sequence: the "
        "demo's 48 held-out episodes took 34 s at 16 and 27 s at 64 (SmolLM2, one thread, "
        "32-token blocks). The KV cache still bounds what runs."))
    max_loras: int = Field(2, ge=1, description=(
        "Adapters active in one batch: the current step and the one before it while it drains."))
    max_cpu_loras: int = Field(4, ge=1, description="Adapters kept loaded; older ones are unloaded.")
    tool_call_parser: str | None = Field("hermes", description=(
        "vLLM tool-call parser. 'hermes' matches the chat template we ship for models whose own "
        "template ignores tools (SmolLM2). None disables tool-call parsing."))
    chat_template: str | None = Field(None, description=(
        "Path to a Jinja chat template overriding the model's own; None keeps the model's."))
    splice_turns: bool = Field(True, description=(
        "Token in, token out: a chat that continues an answer the gateway gave is sent to vLLM "
        "as the earlier prompt's ids + the sampled ids + the rendering of only the new "
        "messages, so the model is conditioned on what it sampled and a multi-turn agent "
        "trains as one sequence (ARCHITECTURE invariant 1). Off: vLLM re-renders every turn."))
    default_max_tokens: int | None = Field(1024, ge=1, description=(
        "Generation cap the gateway applies to a request that sets no max_tokens. Most agent "
        "graphs set none, and a small model can then ramble to the end of the context (minutes "
        "per call on a CPU). None: no cap. A truncated turn has finish_reason 'length' and is "
        "counted in the step metrics (`truncated_turns`)."))
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description=(
        "'auto' lets vLLM pick (bf16 on modern GPUs and on CPUs with AVX512-BF16 or AMX), except "
        "on a CPU without native bf16, where it means float32: there bf16 decodes ~2x slower."))
    gpu_memory_utilization: float = Field(0.45, gt=0.0, le=0.95, description=(
        "CUDA only. Share of GPU memory for vLLM; 0.45 leaves room for the trainer on one GPU."))
    cpu_kv_cache_gib: int = Field(1, ge=1, description=(
        "CPU only (VLLM_CPU_KVCACHE_SPACE). Without it vLLM tries to reserve 92% of RAM."))
    cpu_block_size: int = Field(32, ge=32, multiple_of=32, description=(
        "CPU only. vLLM's KV-cache block size in tokens (vLLM-CPU's default is 128; its "
        "attention takes multiples of 32). The prefix cache reuses whole blocks only, so with "
        "128 up to 127 tokens of a shared prompt (system prompt, tools, earlier turns) are "
        "computed again for every request. Measured, the demo's 48 held-out episodes "
        "(SmolLM2, one thread, 16 sequences): prefix hit rate 91.5% -> 96.3%, 43 -> 34 s."))
    cpu_threads: int = Field(2, ge=1, description=(
        "CPU only. vLLM's OpenMP threads. On a CPU the engine and the trainer take turns (a "
        "step pauses inference), so the engine may have every core while it serves: the "
        "demo's 48 held-out episodes took 27 s with 1 thread and 18 s with 2 (SmolLM2, "
        "2 cores, 64 sequences), its train steps took as long (37 s), and `art demo` went "
        "427 -> 345 s. Training that keeps serving (`keep_serving`, `mode='dedicated'`) "
        "gets the cores left over (at least one): set fewer threads for it."))
    oldest_first: bool = Field(True, description=(
        "Schedule the requests of older conversations first: the gateway gives each request "
        "the time its conversation's first turn arrived as vLLM's priority (vLLM's priority "
        "scheduling; a request that sets its own priority keeps it). Episodes then finish in "
        "the order they started, so the groups a step waits for complete sooner while newer "
        "episodes fill the batch (art_core.PipelineTrainer keeps both in flight); with every "
        "episode started at once (a synchronous step) it is first come, first served."))
    enforce_eager: bool = Field(True, description=(
        "Skip torch.compile/CUDA graphs: starts much faster; vLLM CPU runs eager with LoRA anyway."))
    tensor_parallel_size: int = Field(1, ge=1, description=(
        "CUDA only. vLLM's --tensor-parallel-size: each layer split across this many GPUs of "
        "one host, for models that do not fit one GPU. tensor x data parallel size must not "
        "exceed the visible GPUs (checked before vLLM starts)."))
    data_parallel_size: int = Field(1, ge=1, description=(
        "CUDA only. vLLM's --data-parallel-size: this many engine replicas (each on "
        "tensor_parallel_size GPUs) behind one server, for rollout throughput. vLLM sends a "
        "runtime LoRA load to every replica before it answers."))
    sleep_while_training: bool = Field(True, description=(
        "CUDA only: put vLLM to sleep during a training step so the trainer gets the GPU "
        "memory. (On CPU, pausing vLLM's processes was measured: after SIGCONT its first "
        "requests took seconds to start, more than its idle polling costs the trainer.)"))
    startup_timeout_s: float = Field(300.0, gt=0, description=(
        "How long to wait for vLLM to report healthy. CPU start is ~20-30 s; slow disks more."))
    serve_merged: bool | None = Field(None, description=(
        "Serve the policy's latest step as merged weights (W + BA, reloaded into vLLM in place "
        "after each step), and every other name (older name@step, the base by name, other "
        "models on the base) as a runtime LoRA of its difference from them. None: on a CPU, "
        "where vLLM's LoRA kernels decode ~2x slower than merged weights (FIELD-NOTES, "
        "benchmarks/vs_trl.py), and not on CUDA, where LoRA kernels cost little and a merge "
        "reloads the whole model each step. Merged bf16 weights are rounded stochastically "
        "(unbiased): rounded to nearest, W + BA dropped every update under half a bf16 step "
        "of W, and the demo learned 46% -> 54% held-out, against 40% -> 56% and 38% -> 88% "
        "(stochastic) and 46% -> 71% (float32)."))
    policy_check_tolerance: PositiveFloat | Literal["auto"] | None = Field("auto", description=(
        "The served-policy check at every publish (art_core/inference/policy_check.py): the "
        "largest mean |logprob difference| between what vLLM serves under a step's name and "
        "what the trainer trained, over a fixed ~50-token probe, before the publish fails and "
        "the previous step keeps serving. 'auto': 0.1 where vLLM serves float32, whose "
        "numerics differ far less (measured mean 9e-6, max 5e-5 on SmolLM2 merged; 1e-6 on "
        "the tiny test model), and 0.2 in bf16 or float16, about twice the worst of ~85 "
        "publishes of SmolLM2 merged in bf16 on an AMX CPU (mean 0.04-0.09, once 0.105), where "
        "one step's change (0.04-0.13) is within the noise: there the check catches a policy "
        "several steps stale, the base served in its place, NaNs, not a step that did not "
        "reach vLLM. None: no check."))
    extra_args: list[str] = Field(default_factory=list, description=(
        "Extra command-line arguments passed to vLLM's server as they are."))

    def conflicts(self, running: EngineConfig) -> list[str]:
        """The settings in which this config differs from a running engine's, as
        "engine.<field>=<this> (running: <that>)": a running engine cannot take them, so a
        model that asks for them is refused instead of being served otherwise."""
        return [f"engine.{name}={getattr(self, name)!r} (running: {getattr(running, name)!r})"
                for name in type(self).model_fields
                if name not in RUNTIME_ONLY and getattr(self, name) != getattr(running, name)]


RUNTIME_ONLY = frozenset({"startup_timeout_s", "policy_check_tolerance"})
"""EngineConfig fields that do not shape a running engine (a model may differ in them)."""


class ModelConfig(_Strict):
    """Per-model settings fixed at registration."""

    lora: LoraConfig = Field(default_factory=LoraConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)


LossName = Literal["cispo", "ppo", "gspo", "dppo"]


class TrainConfig(_Strict):
    """One GRPO step. The defaults train SmolLM2-135M on CPU out of the box."""

    learning_rate: float = Field(1e-4, gt=0, description=(
        "AdamW learning rate. LoRA wants ~10x the full fine-tuning rate ('LoRA Without Regret', "
        "2025). 1e-4 is a middle ground for 0.1-8B models at rank 8; the 135M demo model learns "
        "fastest near 1e-3 (tests/engine/test_learning.py), larger models want less."))
    loss: LossName = Field("cispo", description=(
        "'cispo': clipped, detached importance weight times logprob (MiniMax-M1, 2025; ART's "
        "default), keeps a gradient on every token. 'ppo': PPO clipped ratio. 'gspo': "
        "sequence-level ratio (Qwen GSPO, 2025). 'dppo': DPPO-Binary-TV (2026; verl's "
        "dppo_tv): a trust region on the token's probability change, not its ratio. "
        "Measured on the demo (benchmarks/demo_variants.py, 2026-12-06, held-out ~20/48 "
        "before): cispo 41-44/48 after (five runs), dppo 41 and 43, ppo 42 and 43, ppo with "
        "tis_cap=2 42 and 43; on the MCP inventory example (--task mcp, 2026-12-07, 4 steps, "
        "seeds 0 and 1, held-out solved of 48 after): cispo 19 and 35, dppo 25 and 14, ppo 28 "
        "and 34, ppo with tis_cap=2 33 and 25 (the seed moves it more than the loss). No loss "
        "wins beyond noise on either, so the default stays CISPO (ART's)."))
    epsilon_low: float | None = Field(None, ge=0, description=(
        "Lower clip: ratio >= 1 - epsilon_low. None picks the loss's own default: "
        "ppo 0.2 (PPO), cispo 1.0 (no lower bound, as in CISPO), gspo 3e-4 (GSPO paper), "
        "dppo 0.2 (a probability drop: verl's clip_ratio default for dppo_tv)."))
    epsilon_high: float | None = Field(None, ge=0, description=(
        "Upper clip: ratio <= 1 + epsilon_high. None picks: ppo 0.28 (DAPO clip-higher), "
        "cispo 4.0 (caps only outlier weights), gspo 4e-4 (GSPO paper), dppo 0.2 (a "
        "probability rise)."))
    tis_cap: float | None = Field(None, gt=0, description=(
        "Token-level truncated importance sampling against the sampler (Yao et al. 2025, "
        "C = 2 there; on by default in TRL): the loss's trust region is measured against the "
        "trainer's own policy and the sampler/trainer mismatch is weighted by "
        "min(pi_trainer / pi_sampler, tis_cap). With one optimizer step per call this makes "
        "ppo, gspo and dppo the truncated-IS gradient (CISPO's, without a lower bound; "
        "art_core/train/loss.py). None: the ratio against the sampler, as the loss defines."))
    kl_coef: float = Field(0.0, ge=0, description=(
        "Weight of a k3 KL penalty to the base model (the adapter disabled is the reference). "
        "Off by default: DAPO and Dr. GRPO found it unnecessary for verifiable rewards."))
    scale_rewards: bool = Field(True, description=(
        "Divide advantages by the group's reward std (GRPO). Dr. GRPO argues against it for "
        "difficulty bias; on by default because RULER scores have arbitrary scale."))
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping: a standard guard.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay; none for LoRA RL.")
    micro_batch_size: int = Field(4, ge=1, description=(
        "Sequences per forward/backward; gradients accumulate to one optimizer step per call."))
    pack_shared_prefix: bool = Field(True, description=(
        "Forward the prompt that the sequences of a group share once: they train in one row, "
        "each seeing the shared prefix and itself only (a 4-D attention mask; same logprobs "
        "and gradients as one row each). The demo agent's step forwards 2.9x fewer tokens. A "
        "row is never longer than micro_batch_size x the step's longest sequence. Not for "
        "gspo (one ratio per row) or flash attention (no custom masks)."))
    logprob_chunk_size: int = Field(512, ge=16, description=(
        "Tokens per chunk when turning hidden states into logprobs, so the [B, T, vocab] logits "
        "tensor is never held whole."))
    logprob_keep_mb: int = Field(512, ge=0, description=(
        "Keep the float32 log-softmax of a micro-batch's logprob positions for backward while "
        "it fits in this many MB, instead of recomputing the lm head in backward (which costs "
        "~1.6x its time). 512 MB holds 4 x 650 positions of a 49k vocabulary; longer micro-"
        "batches are recomputed, as 0 does always."))
    gradient_checkpointing: bool | Literal["auto"] = Field("auto", description=(
        "Recompute activations in backward: less memory for long agent sequences, ~20% slower "
        "(SmolLM2 on a 2-core CPU: 5.8 s against 4.5 s a step of 1,427 forwarded tokens, "
        "1.3 GB more held without it). 'auto': on a CPU, recompute only when a micro-batch's "
        "activations would exceed 2 GB (art_core/train/trainer.py, `use_checkpointing`); on a "
        "GPU, always (its memory is vLLM's too)."))
    bf16: bool | None = Field(None, description=(
        "bf16 autocast; None = where the hardware supports it (CUDA bf16 or CPU with AVX512-BF16/"
        "AMX; ~2.3x faster than fp32 on these CPUs)."))
    max_sequence_tokens: int | None = Field(None, ge=16, description=(
        "Longest training sequence (prompt and completion tokens) accepted; a longer one is "
        "refused when the step is submitted, before anything is journaled, because it would "
        "fail in the trainer after minutes (a 200k-token prompt asked for a 40 GB attention "
        "mask). None: the base model's context length (max_position_embeddings)."))
    allow_retokenize: bool = Field(False, description=(
        "Trajectories whose assistant turns carry no sampled tokens are an error unless this is "
        "set; then they are rendered through the chat template (counted in a metric, warned)."))
    seed: int = Field(0, description="Seed for the step's shuffling; results are reproducible.")
    advantage: Literal["group", "teacher", "turn"] = Field("group", description=(
        "'group': GRPO's group-relative reward advantage (zero-variance groups dropped); the "
        "default, because the demo's learning runs measured it, and per-turn credit did not "
        "beat it on the MCP inventory example (a reward per turn, its progress on the stock; "
        "held-out solved of 48 after 4 steps, seeds 0-2: episode 19, 35, 22, per turn 39, 10, "
        "24; benchmarks/README.md). "
        "'turn': per-turn credit (art_core/train/credit.py): each sampled turn's return-to-go "
        "(its own and later turns' rewards, `SampledTurn.reward`) against the other "
        "trajectories of its group at the same turn, an unbiased leave-one-out baseline; with "
        "no turn rewards it is group-relative without the std. "
        "'teacher': on-policy distillation (Agarwal et al. 2024, GKD; Thinking Machines, "
        "'On-Policy Distillation', 2025): each sampled token's advantage is teacher logprob - "
        "sampler logprob, the negative per-token reverse KL estimate, so the student moves "
        "towards the teacher on its own samples; rewards are unused and every trajectory "
        "trains. Needs `SampledTurn.teacher_logprobs` (art_core.distill.score_with_teacher); "
        "not with loss='gspo', whose ratio and advantage are per sequence."))

    def model_post_init(self, context: object) -> None:
        if self.advantage in ("teacher", "turn") and self.loss == "gspo":
            raise ValueError(f"advantage={self.advantage!r} gives one advantage per token; "
                             "loss='gspo' takes one per sequence: use loss='cispo' or 'ppo'")

    def clip_bounds(self) -> tuple[float, float]:
        """(epsilon_low, epsilon_high), resolved to the loss's own defaults where unset."""
        defaults = {"ppo": (0.2, 0.28), "cispo": (1.0, 4.0), "gspo": (3e-4, 4e-4),
                    "dppo": (0.2, 0.2)}[self.loss]
        low = defaults[0] if self.epsilon_low is None else self.epsilon_low
        high = defaults[1] if self.epsilon_high is None else self.epsilon_high
        return low, high


class SFTConfig(_Strict):
    """One supervised fine-tuning call (`model.train_sft`): several optimizer updates over the
    data, committed as one checkpoint step of the same LoRA that RL trains."""

    epochs: int = Field(3, ge=1, description=(
        "Passes over the data. Agent SFT sets are small (tens to hundreds of trajectories): one "
        "pass moves a rank-8 LoRA little; more than a few overfits the worked format."))
    batch_size: int = Field(8, ge=1, description=(
        "Examples per optimizer update; the loss is the mean over the batch's trained tokens."))
    micro_batch_size: int = Field(4, ge=1, description=(
        "Rows per forward/backward; gradients accumulate to one update per batch."))
    learning_rate: float = Field(2e-4, gt=0, description=(
        "Peak AdamW rate: the common LoRA SFT rate (QLoRA, 2023) for 0.1-8B models, 2x the RL "
        "default because the supervised signal is dense and certain. The 135M demo model with a "
        "few dozen examples learns far faster at 1e-3 (benchmarks/sft_warmstart.py: 29 "
        "examples at 1e-3 reached 94% held-out, 19 at 2e-4 reached 19%)."))
    schedule: Literal["constant", "linear", "cosine"] = Field("cosine", description=(
        "Rate over the call's updates after warm-up: cosine to 0 (the usual SFT schedule), "
        "linear to 0, or constant."))
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description=(
        "Share of the updates that ramp the rate up linearly; LoRA starts at B = 0, so little "
        "is needed."))
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay; none for LoRA.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping: a standard guard.")
    assistant_turns: Literal["all", "last"] = Field("all", description=(
        "Which assistant turns are trained: every one (tool calls included), or the last only "
        "(e.g. data whose earlier turns came from another policy). Messages with weight 0 are "
        "never trained (OpenAI's fine-tuning format)."))
    max_length: int | None = Field(None, ge=16, description=(
        "Longest example in tokens; None: the base model's context length."))
    over_long: Literal["skip", "error"] = Field("skip", description=(
        "An example longer than max_length: skipped and counted in the metrics "
        "(`skipped_over_long`), or an error naming it. Never truncated: a cut example would "
        "teach a conversation that stops mid-turn."))
    packing: bool = Field(True, description=(
        "Examples that share a prefix (the same system prompt and tools) train in one row over "
        "it, forwarded once (art_core/train/packing.py): same loss and gradients, fewer tokens."))
    gradient_checkpointing: bool | Literal["auto"] = Field("auto", description=(
        "Recompute activations in backward: less memory for long agent examples, ~20% slower. "
        "'auto': as TrainConfig's, judged on micro_batch_size x the longest example."))
    bf16: bool | None = Field(None, description="bf16 autocast; None = where supported.")
    seed: int = Field(0, description="Seed of the shuffle between epochs: reproducible runs.")
