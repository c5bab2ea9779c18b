"""Tiny assets for verl's trainer on CPU, made offline by code (no hub): a byte-level BPE
tokenizer with a chat template, a 2-layer Qwen2 (fixed seed), parquet prompts in verl's gsm8k
layout whose prompts are long next to the responses (so a GRPO group shares most of its
tokens), and a reward that varies within a group (so advantages and gradients are non-zero)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL_TOKENS = ["<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = ("apple banana cherry river mountain seven eleven twenty count total each basket holds "
         "more than less how many does she have left after giving away buys sells").split()

REWARD_SOURCE = '''"""Toy reward: a fixed function of the response text (it varies in a group)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (sum(map(ord, solution_str)) % 7) / 6.0
'''


@dataclass(frozen=True)
class TinyAssets:
    model: Path
    train_files: Path
    val_files: Path
    reward: Path


def make_tiny_assets(root: str | Path, *, num_prompts: int = 8, seed: int = 0) -> TinyAssets:
    """Write everything under ``root`` (idempotent: existing files are kept)."""
    root = Path(root)
    assets = TinyAssets(root / "model", root / "train.parquet", root / "val.parquet",
                        root / "reward.py")
    if not (assets.model / "config.json").exists():
        _write_model(assets.model, seed)
    if not assets.train_files.exists():
        _write_prompts(assets.train_files, num_prompts, seed)
        _write_prompts(assets.val_files, 2, seed + 1)
    if not assets.reward.exists():
        assets.reward.write_text(REWARD_SOURCE)
    return assets


def _prompt_text(rng, index: int) -> str:
    # 24-39 words: 100-200 tokens after the tiny BPE, unequal across prompts
    return f"Question {index}: " + " ".join(rng.choice(WORDS) for _ in range(24 + index % 16))


def _write_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([" ".join(WORDS)] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|pad|>",
                                   eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    # transformers 5 names its own backend class; 4.x (verl 0.8.0) knows only this one
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2))
    return fast


def _write_model(path: Path, seed: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = _write_tokenizer(path)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)


def _write_prompts(path: Path, num_prompts: int, seed: int) -> None:
    import random

    import pandas as pd

    rng = random.Random(seed)
    rows = []
    for index in range(num_prompts):
        question = _prompt_text(rng, index)
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(index)},
            "extra_info": {"split": path.stem, "index": index, "answer": str(index),
                           "question": question},
        })
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


if __name__ == "__main__":
    import sys

    print(json.dumps({k: str(v) for k, v in vars(make_tiny_assets(sys.argv[1])).items()}))
