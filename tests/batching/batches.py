"""The batches issue 29's figures are measured on: verl-sized GRPO and tree batches."""

import torch

from prefix_sharing.workloads import grpo, tree

VOCAB = 32_000  # a real vocabulary: no sharing by coincidence across groups


def grpo_batch(seed: int = 0):
    """64 prompts x 8 responses, prompts 100-400 tokens, responses 50-1000: 512 samples, and
    their uids (one per prompt) and prompt lengths."""
    w = grpo(num_prompts=64, group_size=8, prompt_len=(100, 400), response_len=(50, 1000),
             vocab_size=VOCAB, seed=seed)
    uids = [f"prompt{g}" for g, group in enumerate(w.groups) for _ in group.members]
    prompt_lens = [group.prompt_len for group in w.groups for _ in group.members]
    return w.sequences, uids, prompt_lens


# (depth, branching) of the trees, in turn: 10, 18, 29, 11, 6 and 18 samples each
_SHAPES = [(3, 2), (2, 4), (3, 3), (1, 9), (2, 2), (4, 2)]


def tree_batch(num_samples: int = 512, seed: int = 0) -> list[torch.Tensor]:
    """Tree rollouts of uneven sizes (each with a duplicated leaf and a strict-prefix path),
    prompts 100-400 tokens, nodes 30-300: the last tree cut to give ``num_samples``. No uids:
    the groups are the prefix trees."""
    sequences: list[torch.Tensor] = []
    k = 0
    while len(sequences) < num_samples:
        depth, branching = _SHAPES[k % len(_SHAPES)]
        w = tree(depth=depth, branching=branching, prompt_len=(100, 400), node_len=(30, 300),
                 vocab_size=VOCAB, seed=seed * 1000 + k)
        sequences += w.sequences
        k += 1
    return sequences[:num_samples]
