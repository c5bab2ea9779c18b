"""Seeded micro-batches with the sharing shapes of RL training.

``grpo``: G responses per prompt. ``steprl``: step-wise chains, each step's sample extending the
previous one. ``tree``: tree rollouts, with a duplicated leaf and a strict-prefix path. ``agent``:
multi-turn episodes under one system prompt, branching at turn boundaries. ``history``: one long
agent history and its branches (a group larger than a micro-batch). ``none``: nothing in
common, not even a first token. Every workload also carries its prompt groups (for
``mode="prompt_only"``), as verl's ``uid`` would give them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .planner import PromptGroup

__all__ = ["Workload", "WORKLOADS", "LONG_WORKLOADS", "make_workload", "scale_lengths", "grpo", "steprl", "tree",
           "agent", "history", "none"]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    sequences: list[torch.Tensor]
    groups: list[PromptGroup]

    @property
    def num_tokens(self) -> int:
        return sum(s.numel() for s in self.sequences)


class _Tokens:
    """Random token ids and lengths from one seeded generator."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def length(self, span: tuple[int, int]) -> int:
        lo, hi = span
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))

    def ids(self, span: tuple[int, int] | int) -> torch.Tensor:
        n = span if isinstance(span, int) else self.length(span)
        return torch.randint(0, self.vocab_size, (n,), generator=self.gen)


def grpo(
    num_prompts: int = 3, group_size: int = 4, prompt_len: tuple[int, int] = (12, 24),
    response_len: tuple[int, int] = (4, 16), vocab_size: int = 101, seed: int = 0,
) -> Workload:
    """``num_prompts`` prompts, ``group_size`` sampled responses each (GRPO / RLOO groups)."""
    rng = _Tokens(vocab_size, seed)
    sequences, groups = [], []
    for _ in range(num_prompts):
        prompt = rng.ids(prompt_len)
        members = list(range(len(sequences), len(sequences) + group_size))
        sequences += [torch.cat([prompt, rng.ids(response_len)]) for _ in members]
        groups.append(PromptGroup(prompt.numel(), members))
    return Workload("grpo", sequences, groups)


def steprl(
    num_chains: int = 2, num_steps: int = 4, prompt_len: tuple[int, int] = (12, 24),
    step_len: tuple[int, int] = (4, 10), vocab_size: int = 101, seed: int = 0,
) -> Workload:
    """Step-wise RL: sample ``k`` of a chain is the prompt plus its first ``k`` steps."""
    rng = _Tokens(vocab_size, seed)
    sequences, groups = [], []
    for _ in range(num_chains):
        prompt = rng.ids(prompt_len)
        context = prompt
        members = []
        for _ in range(num_steps):
            context = torch.cat([context, rng.ids(step_len)])
            members.append(len(sequences))
            sequences.append(context)
        groups.append(PromptGroup(prompt.numel(), members))
    return Workload("steprl", sequences, groups)


def tree(
    depth: int = 3, branching: int = 2, prompt_len: tuple[int, int] = (12, 24),
    node_len: tuple[int, int] = (3, 8), vocab_size: int = 101, seed: int = 0,
) -> Workload:
    """Root-to-leaf paths of a random tree, plus a duplicated leaf and an inner (strict) path."""
    rng = _Tokens(vocab_size, seed)
    prompt = rng.ids(prompt_len)
    paths = [prompt]
    for _ in range(depth):
        paths = [torch.cat([p, rng.ids(node_len)]) for p in paths for _ in range(branching)]
    inner = paths[0][: prompt.numel() + 1]  # a strict prefix of the first leaf
    sequences = paths + [paths[-1].clone(), inner]
    return Workload("tree", sequences, [PromptGroup(prompt.numel(), list(range(len(sequences))))])


def agent(
    num_tasks: int = 2, num_turns: int = 3, branching: int = 2, system_len: int = 24,
    task_len: tuple[int, int] = (6, 12), turn_len: tuple[int, int] = (4, 10),
    vocab_size: int = 101, seed: int = 0,
) -> Workload:
    """Multi-turn agent episodes: one system prompt, a task each, branching at every turn."""
    rng = _Tokens(vocab_size, seed)
    system = rng.ids(system_len)
    sequences, groups = [], []
    for _ in range(num_tasks):
        prompt = torch.cat([system, rng.ids(task_len)])
        episodes = [prompt]
        for turn in range(num_turns):
            fan = branching if turn < num_turns - 1 else 1
            # assistant turn (sampled) + tool/user reply (from the environment)
            episodes = [torch.cat([e, rng.ids(turn_len), rng.ids(turn_len)])
                        for e in episodes for _ in range(fan)]
        groups.append(PromptGroup(prompt.numel(), list(range(len(sequences), len(sequences) + len(episodes)))))
        sequences += episodes
    return Workload("agent", sequences, groups)


def history(
    history_len: int = 512, branches: int = 8, branch_len: int = 32, vocab_size: int = 101,
    seed: int = 0,
) -> Workload:
    """``branches`` continuations of ``branch_len`` tokens after one ``history_len``-token
    history (an agent's long context, sampled ``branches`` ways): one group whose common
    prefix is exactly the history (the branches' first tokens are distinct)."""
    if not 2 <= branches <= vocab_size:
        raise ValueError(f"history: branches must be between 2 and the vocabulary "
                         f"({vocab_size}) for distinct first tokens; got {branches}")
    if history_len < 1 or branch_len < 1:
        raise ValueError(f"history: history_len and branch_len must be at least 1; got "
                         f"{history_len} and {branch_len}")
    rng = _Tokens(vocab_size, seed)
    past = rng.ids(history_len)
    firsts = torch.randperm(vocab_size, generator=rng.gen)[:branches]
    sequences = [torch.cat([past, f.view(1), rng.ids(branch_len - 1)]) for f in firsts]
    return Workload("history", sequences, [PromptGroup(history_len, list(range(branches)))])


def none(
    num_sequences: int = 8, seq_len: tuple[int, int] = (12, 32), vocab_size: int = 101,
    seed: int = 0,
) -> Workload:
    """Unrelated sequences: distinct first tokens, so not even one token is shared."""
    if num_sequences > vocab_size:
        raise ValueError(f"none: {num_sequences} sequences need as many distinct first tokens")
    rng = _Tokens(vocab_size, seed)
    firsts = torch.randperm(vocab_size, generator=rng.gen)[:num_sequences]
    sequences = [torch.cat([f.view(1), rng.ids(seq_len)]) for f in firsts]
    return Workload("none", sequences, [PromptGroup(0, [i]) for i in range(num_sequences)])


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "grpo": grpo, "steprl": steprl, "tree": tree, "agent": agent, "none": none,
}
# Built by name only, not among the defaults every workload loop runs (the demo, the step
# bench, the recurrent tests): one group larger than a micro-batch, for --token-budget views.
LONG_WORKLOADS: dict[str, Callable[..., Workload]] = {"history": history}


def make_workload(name: str, **kwargs: object) -> Workload:
    """The built-in workload ``name`` (one of :data:`WORKLOADS` or :data:`LONG_WORKLOADS`)
    with its size options."""
    known = {**WORKLOADS, **LONG_WORKLOADS}
    if name not in known:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(known)}")
    return known[name](**kwargs)


def scale_lengths(sizes: dict[str, object], factor: int) -> dict[str, object]:
    """``sizes`` (a workload's keyword arguments) with every length (``*_len``) ``factor`` times.

    The sharing shape stays (the same sequences, groups and branch structure); only the
    segments grow. A small model's step on the bench's ~2k-token micro-batches is mostly
    per-operator cost, the same plain and shared; longer segments show the same plan where the
    products dominate, as they do on a real model's micro-batches of 10k+ tokens.
    """
    if factor < 1:
        raise ValueError(f"the length scale must be at least 1; got {factor}")

    def scaled(value: object) -> object:
        return tuple(v * factor for v in value) if isinstance(value, tuple) else value * factor

    return {key: scaled(value) if key.endswith("_len") else value
            for key, value in sizes.items()}
