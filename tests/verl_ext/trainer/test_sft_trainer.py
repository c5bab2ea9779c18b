"""verl's real SFT trainer end to end on CPU: ``torchrun -m verl.trainer.sft_trainer``, FSDP2,
3 steps on multi-turn conversations that share a long system prompt (verl's
``MultiTurnSFTDataset`` and collator), through ``prefix_sharing.testing.verl_cpu``; sharing on
(``+engine.use_prefix_grouper=true +engine.prefix_grouper.mode=arbitrary_prefix``) against
``ENABLE_PREFIX_SHARING=0`` with the same config.

verl's SFT loss is the global token mean (``sft_loss``: over ``batch_num_tokens`` x
``dp_size``), so the loss and grad_norm of every step must agree to fp32 rounding, and with
them the loss curve (each step trains on the previous one's update). The token ratio the
engine logs per step (``prefix_sharing/token_ratio``, the metric the actor logs) says the
shared system prompt was computed once per micro-batch.

verl 0.9.1 only, for CI time (each run ~50 s on 2 loaded cores, mostly start-up); verl 0.8.0's
SFT trainer ran the same overrides by hand with the same figures (see docs/verl.md).
"""

from __future__ import annotations

import math

import pytest

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

from prefix_sharing.testing.verl_cpu.sft import run_sft_trainer, tiny_sft_overrides  # noqa: E402

STEPS = 3
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_trainer")
    overrides = tiny_sft_overrides(root / "assets", steps=STEPS)
    return (run_sft_trainer(root / "on", overrides, enable_sharing=True),
            run_sft_trainer(root / "off", overrides, enable_sharing=False))


def test_loss_curve_and_grad_norm_match_the_stock_trainer(runs):
    on, off = runs
    assert len(on.steps) == len(off.steps) == STEPS
    for step, (a, b) in enumerate(zip(on.steps, off.steps), 1):
        for name in ("train/loss", "train/grad_norm"):
            assert math.isfinite(b[name]) and b[name] != 0, f"step {step} {name}: {b[name]}"
            assert abs(a[name] - b[name]) <= RTOL * abs(b[name]), (
                f"step {step} {name}: on {a[name]!r} off {b[name]!r}")
        assert a["train/global_tokens"] == b["train/global_tokens"]
    assert off.steps[-1]["train/loss"] < off.steps[0]["train/loss"]  # it trains


def system_prompt_tokens(assets) -> int:
    """The tokens of the conversations' shared system turn, as verl's dataset tokenizes it
    (the chat template applied to that turn alone)."""
    import pandas as pd
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    first = pd.read_parquet(assets / "sft_train.parquet")["messages"][0][0]
    text = tokenizer.apply_chat_template([dict(first)], tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_shared_system_prompt_is_computed_once_per_micro_batch(runs):
    on, off = runs
    system = system_prompt_tokens(on.workdir.parent / "assets")
    for metrics in on.steps:
        total = metrics["prefix_sharing/tokens_total"][0][0]
        computed = metrics["prefix_sharing/tokens_computed"][0][0]
        micro_batches = metrics["prefix_sharing/num_micro_batches"][0][0]
        assert total == metrics["train/global_tokens"]  # every token the batch holds is read
        # micro-batches of 2 conversations: each computes the system prompt once, not twice
        assert micro_batches == 2 and total - computed >= micro_batches * system > 0
        assert metrics["prefix_sharing/token_ratio"][0][0] == pytest.approx(total / computed)
    assert not any(key.startswith("prefix_sharing/") for key in off.steps[0])
