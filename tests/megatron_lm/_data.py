"""Generated training data for the Megatron-LM tests: conversations sharing system prompts and
histories (Megatron-LM's SFT JSONL, with a word-level HuggingFace tokenizer for its
``SFTTokenizer``), and tree-shaped / unshared trajectory files (``prefix-sharing analyze``'s
format)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = [f"w{i}" for i in range(200)]
SPECIAL = ["<unk>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>"]


def write_tokenizer(directory: Path) -> Path:
    """A word-level tokenizer (whitespace split) with the special tokens of Megatron-LM's
    ``nemotron-h-aligned`` SFT prompt format; vocabulary of 208."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + ["System", "User", "Assistant"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   additional_special_tokens=SPECIAL[1:])
    fast.save_pretrained(directory)
    return directory


def _text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


def write_conversations(path: Path, *, shared: bool, lines: int = 8, seed: int = 0) -> Path:
    """SFT JSONL: each line packs 3 conversations. With ``shared``, every conversation of a
    line opens with the same long system prompt (two prompts in the file) and the 2nd and 3rd
    continue the same first exchange (a shared history); else nothing repeats."""
    rng = np.random.default_rng(seed)
    systems = [_text(rng, 24), _text(rng, 24)]
    with open(path, "w") as file:
        for line in range(lines):
            system = systems[line % 2] if shared else _text(rng, 24)
            history = [{"role": "user", "content": _text(rng, 10)},
                       {"role": "assistant", "content": _text(rng, 8)}]
            messages = []
            for c in range(3):
                turns = history if shared and c > 0 else [
                    {"role": "user", "content": _text(rng, 10)},
                    {"role": "assistant", "content": _text(rng, 8)}]
                messages += [{"role": "system", "content": system if shared else _text(rng, 24)},
                             *turns,
                             {"role": "user", "content": _text(rng, int(rng.integers(3, 8)))},
                             {"role": "assistant", "content": _text(rng, int(rng.integers(3, 8)))}]
            file.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_trajectories(path: Path, *, tree: bool, trees: int = 6, seed: int = 0) -> Path:
    """Rollouts with ``prompt_ids`` / ``response_ids``: with ``tree``, each prompt (40 tokens)
    branches into 2 partial responses (20 tokens) that branch again into 2 endings (5-14
    tokens): 4 leaves per tree sharing the prompt and pairwise the partial response. Without,
    every row is unrelated."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(trees):
        prompt = rng.integers(1, 500, 40).tolist()
        for _ in range(2):
            middle = rng.integers(1, 500, 20).tolist()
            for _ in range(2):
                if not tree:
                    prompt = rng.integers(1, 500, 40).tolist()
                    middle = rng.integers(1, 500, 20).tolist()
                ending = rng.integers(1, 500, int(rng.integers(5, 15))).tolist()
                rows.append({"prompt_ids": prompt, "response_ids": middle + ending})
    with open(path, "w") as file:
        file.writelines(json.dumps(r) + "\n" for r in rows)
    return path


if __name__ == "__main__":  # python -m tests.megatron_lm._data DIR: the SFT example's data
    import sys

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out / "tok")
    lines = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    write_conversations(out / "convs.jsonl", shared=True, lines=lines)
    print(out / "convs.jsonl", out / "tok")
