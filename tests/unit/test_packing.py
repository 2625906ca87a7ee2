"""Shared prompt prefixes trained once (art_core/train/packing.py): which sequences pack, the
row's positions and 4-D mask, and that a packed row gives the logprobs, loss and update of one
row per sequence on a real (tiny, random) model, for both attention kernels that take the mask."""

from __future__ import annotations

import pytest
import torch

from art_core import LoraConfig, TrainConfig
from art_core.train import advantages as A
from art_core.train import batch as B
from art_core.train import packing as P
from art_core.train.loss import grpo_loss
from art_core.train.trainer import Trainer
from art_core.trajectory import Trajectory, TrajectoryGroup
from tests.support.data import lora_state


def seq(tokens: list[int], trained_from: int, *, traj: int = 0, adv: float = 1.0,
        has_old: bool = True) -> B.Sequence:
    n = len(tokens)
    mask = [0] * trained_from + [1] * (n - trained_from)
    return B.Sequence(tokens, mask, [-1.0 * m for m in mask], adv, traj,
                      has_old_logprobs=has_old, token_weight=0.1)


PROMPT = list(range(100, 140))  # 40 untrained tokens every sequence below starts with


@pytest.mark.parametrize("case", [
    dict(name="a group shares its prompt less one token",
         seqs=[PROMPT + [1, 2], PROMPT + [3], PROMPT + [4, 5, 6]], budget=1000, rows=[(39, 3)]),
    dict(name="a prefix under MIN_SHARED is not shared",
         seqs=[PROMPT[:10] + [1, 2], PROMPT[:10] + [3, 4]], budget=1000, rows=[(0, 1), (0, 1)]),
    dict(name="the budget closes a row",
         seqs=[PROMPT + [1, 2], PROMPT + [3, 4], PROMPT + [5, 6]], budget=39 + 3 * 2,
         rows=[(39, 2), (0, 1)]),
    dict(name="a common trained start is not shared: the prefix ends before it",
         seqs=[PROMPT + [7, 7, 1], PROMPT + [7, 7, 2]], trained_from=40, budget=1000,
         rows=[(39, 2)]),
    dict(name="a shorter shared part lowers the whole row's prefix",
         seqs=[PROMPT + [1], PROMPT + [2], PROMPT[:35] + [9, 9]], trained_from=35, budget=1000,
         rows=[(34, 3)]),
    dict(name="re-rendered sequences keep a row of their own",
         seqs=[PROMPT + [1], PROMPT + [2]], has_old=False, budget=1000, rows=[(0, 1), (0, 1)]),
], ids=lambda c: c["name"])
def test_share_prefixes(case):
    sequences = [seq(t, case.get("trained_from", len(t) - 1), traj=i,
                     has_old=case.get("has_old", True)) for i, t in enumerate(case["seqs"])]
    rows = P.share_prefixes(sequences, case["budget"])
    shape = sorted(((r.prefix, len(r.sequences)) if isinstance(r, P.Packed) else (0, 1)
                    for r in rows), reverse=True)
    assert shape == case["rows"]
    members = [s.traj_index for r in rows
               for s in (r.sequences if isinstance(r, P.Packed) else (r,))]
    assert sorted(members) == list(range(len(sequences)))  # every sequence exactly once
    for r in rows:
        if isinstance(r, P.Packed):
            assert len(r) <= case["budget"]
            assert P.forwarded_tokens([r]) == len(r) < sum(len(s) for s in r.sequences)


@pytest.mark.parametrize("bad, message", [
    (lambda: P.Packed(39, (seq(PROMPT + [1], 40),)), "at least two"),
    (lambda: P.Packed(0, (seq(PROMPT + [1], 40), seq(PROMPT + [2], 40))), "shared prefix"),
    (lambda: P.Packed(39, (seq(PROMPT + [1], 40), seq([0] + PROMPT[1:] + [2], 40))), "share"),
    (lambda: P.Packed(39, (seq(PROMPT + [1], 39), seq(PROMPT + [2], 40))), "untrained"),
])
def test_a_packed_row_refuses_what_cannot_share(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def test_collate_places_the_prefix_once_and_each_rest_after_it():
    a = seq([5, 6, 7, 1, 2], 3, traj=0, adv=1.0)  # prefix [5, 6], then [7, 1, 2]
    b = seq([5, 6, 7, 3], 3, traj=1, adv=-1.0)  # then [7, 3]
    alone = seq([8, 9, 4], 2, traj=2, adv=0.5)
    batch = P.collate([alone, _packed(2, a, b)], pad_id=0)
    # row 0: the lone sequence, padded; row 1: 5 6 | 7 1 2 | 7 3
    assert batch["input_ids"].tolist() == [[8, 9, 4, 0, 0, 0, 0], [5, 6, 7, 1, 2, 7, 3]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 0, 0], [0, 1, 2, 3, 4, 2, 3]]
    assert batch["loss_mask"].int().tolist()[1] == [0, 0, 0, 1, 1, 0, 1]
    assert batch["advantages"].tolist()[1] == [0, 0, 1, 1, 1, -1, -1]
    allowed = batch["attention_mask"][1, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],  # b's tokens see the prefix and themselves, never a's
        [1, 1, 0, 0, 0, 1, 1],
    ]
    padded = batch["attention_mask"][0, 0].int()
    assert padded[:3, :3].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert torch.equal(padded[3:, 3:], torch.eye(4, dtype=torch.int))  # padding sees itself
    shifted = B.shift_for_next_token(batch)
    assert shifted["advantages"].shape == shifted["loss_mask"].shape == (2, 6)
    assert not shifted["loss_mask"][1, 4]  # a's last token is followed by b's untrained first


def _packed(prefix: int, *sequences: B.Sequence) -> P.Packed:
    """A Packed row below MIN_SHARED, for hand-sized cases (the class allows any prefix >= 1)."""
    return P.Packed(prefix, sequences)


# ---- on a model -------------------------------------------------------------------------------

SYSTEM = ("You answer questions about countries. Call the lookup tool with the country's name, "
          "wait for its result, then answer in one short sentence that states the fact the "
          "tool returned. Worked example: the capital of Peru is Lima.")


def agent_group(tokenizer, n: int = 4, system: str = SYSTEM) -> TrajectoryGroup:
    """n two-turn episodes from one long prompt: a call, its result, an answer; varied rewards."""
    prompt = tokenizer.encode(system + " Question: what is the capital of Chile?")
    trajectories = []
    for i in range(n):
        first = tokenizer.encode(f" lookup(Chile) try {i}")
        tool = tokenizer.encode(f" result: Santiago {'!' * i}")
        answer = tokenizer.encode(" The capital is Santiago." if i % 2 else " It is Lima.")
        turns = [
            {"message_index": 1, "prompt_token_ids": prompt, "completion_token_ids": first,
             "logprobs": [-2.0] * len(first), "step": 0},
            {"message_index": 3, "prompt_token_ids": prompt + first + tool,
             "completion_token_ids": answer, "logprobs": [-1.5] * len(answer), "step": 0},
        ]
        trajectories.append(Trajectory(
            messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                      {"role": "user", "content": "t"}, {"role": "assistant", "content": "b"}],
            turns=turns, reward=float(i % 2) + 0.1 * i))
    return TrajectoryGroup(trajectories=trajectories)


def group_sequences(tokenizer, system: str = SYSTEM) -> list[B.Sequence]:
    scored, _ = A.compute_advantages([agent_group(tokenizer, system=system)], scale_rewards=True)
    sequences, _ = B.build_all_sequences(scored)
    return B.with_token_weights(sequences)


@pytest.mark.parametrize(("arch", "attention", "system"), [
    ("llama", "sdpa", SYSTEM), ("llama", "eager", SYSTEM), ("qwen3", "sdpa", SYSTEM),
    ("qwen2", "sdpa", SYSTEM),
    ("gemma3", "sdpa", ""),  # no system prompt: shorter than its 64-token window, packable
])
def test_a_packed_row_gives_each_sequences_own_logprobs(tiny_models, arch, attention, system):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_models[arch])
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=attention).eval()
    sequences = group_sequences(tokenizer, system)
    assert P.can_pack(model.config, max(len(s) for s in sequences))
    (row,) = P.share_prefixes(sequences, max_tokens=10_000)
    assert isinstance(row, P.Packed) and len(row.sequences) == len(sequences)

    def logprobs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch.get("position_ids")).logits[:, :-1]
        lp = logits.float().log_softmax(-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        return lp[batch["loss_mask"][:, 1:]]  # trained tokens, in row order

    packed = P.collate([row], pad_id=0)
    packed["attention_mask"] = P.mask_for(packed["attention_mask"], attention)
    alone = torch.cat([logprobs(B.collate([s], pad_id=0)) for s in row.sequences])
    together = logprobs(packed)
    assert together.shape == alone.shape == (sum(s.num_trained_tokens for s in sequences),)
    assert torch.allclose(together, alone, atol=1e-5), (together - alone).abs().max()


def test_a_step_on_packed_rows_updates_the_adapter_as_unpacked_rows_do(tiny_models):
    def run(pack: bool) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
        torch.manual_seed(0)  # the same lora_A init in both runs
        trainer = Trainer(str(tiny_models["llama"]), LoraConfig(rank=4), device="cpu")
        trainer.model.float()  # a bf16 base rounds the two layouts differently (~1e-3)
        config = TrainConfig(learning_rate=1e-2, bf16=False, pack_shared_prefix=pack)
        group = agent_group(trainer.tokenizer)
        before = lora_state(trainer)
        metrics = [trainer.step([group], config) for _ in range(2)]  # lora_B starts at 0
        after = lora_state(trainer)
        assert all(not torch.equal(before[n], after[n]) for n in before)
        return metrics, after

    (m_plain, s_plain), (m_packed, s_packed) = run(False), run(True)
    assert m_packed[0]["packed_rows"] == 1 and m_plain[0]["packed_rows"] == 0
    assert m_packed[0]["forwarded_tokens"] < m_plain[0]["forwarded_tokens"] == m_plain[0]["tokens"]
    for a, b in zip(m_plain, m_packed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    for name in s_plain:
        # Adam normalises the step (lr 1e-2), so float noise of ~1e-7 in a gradient shows as ~1e-6
        assert torch.allclose(s_packed[name], s_plain[name], atol=2e-5), (
            name, (s_packed[name] - s_plain[name]).abs().max())


def test_a_sliding_window_shorter_than_a_sequence_is_not_packed(tiny_models):
    """Gemma 3's tiny model slides a 64-token window: the full-attention mask of a packed row
    would let its longer sequences see past it, so the trainer keeps one row each."""
    trainer = Trainer(str(tiny_models["gemma3"]), LoraConfig(rank=4), device="cpu")
    config = trainer.model.get_base_model().config
    assert config.sliding_window == 64
    assert P.can_pack(config, 64) and not P.can_pack(config, 65)
    metrics = trainer.step([agent_group(trainer.tokenizer)],
                           TrainConfig(learning_rate=1e-2, bf16=False))
    assert metrics["packed_rows"] == 0 and metrics["forwarded_tokens"] == metrics["tokens"] > 64


def test_gspo_keeps_one_row_per_sequence(tiny_models):
    trainer = Trainer(str(tiny_models["llama"]), LoraConfig(rank=4), device="cpu")
    metrics = trainer.step([agent_group(trainer.tokenizer)],
                           TrainConfig(learning_rate=1e-2, bf16=False, loss="gspo"))
    assert metrics["packed_rows"] == 0 and metrics["forwarded_tokens"] == metrics["tokens"]


def test_per_token_advantages_equal_per_row_ones_and_gspo_refuses_them():
    torch.manual_seed(0)
    logp, old = -torch.rand(3, 5), -torch.rand(3, 5)
    mask = torch.rand(3, 5) > 0.3
    adv = torch.tensor([1.0, -0.5, 0.25])
    for loss in ("ppo", "cispo"):
        row, _ = grpo_loss(logp, old, adv, mask, loss=loss, epsilon_low=0.2, epsilon_high=0.28)
        token, _ = grpo_loss(logp, old, adv[:, None].expand(3, 5), mask, loss=loss,
                             epsilon_low=0.2, epsilon_high=0.28)
        assert torch.allclose(row, token)
    with pytest.raises(ValueError, match="gspo"):
        grpo_loss(logp, old, adv[:, None].expand(3, 5), mask, loss="gspo",
                  epsilon_low=3e-4, epsilon_high=4e-4)


def test_equal_sequences_of_the_same_prompt_stay_separate_rows_of_the_row():
    """Two trajectories that sampled the same tokens still each train (two segments)."""
    a, b = seq(PROMPT + [1, 2], 40, traj=0, adv=1.0), seq(PROMPT + [1, 2], 40, traj=1, adv=-1.0)
    (row,) = P.share_prefixes([a, b], 1000)
    assert isinstance(row, P.Packed) and [s.traj_index for s in row.sequences] == [0, 1]
    batch = P.collate([row], pad_id=0)
    assert int(batch["loss_mask"].sum()) == 4
    assert sorted(set(batch["advantages"][batch["loss_mask"]].tolist())) == [-1.0, 1.0]
