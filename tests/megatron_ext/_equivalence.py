"""Runs a megatron GPTModel on planned micro-batches and on the plain inputs, inside one rank.

Three ways to compute the same micro-batches, all through ``get_forward_backward_func`` (so
pipeline parallelism is exercised exactly as in training):

- ``shared``: the prefix-sharing layer spec on the plan's flat layout (K/V injection);
- ``identity``: the same model on the plain packed layout (``mode="off"``: nothing shared);
- ``stock``: megatron's own local spec on right-padded ``[b, s]`` input, log-probs from the
  gathered full-vocabulary logits, one sequence at a time - nothing of this package involved.

Each returns the packed logits, log-probs, entropy and loss of every micro-batch (on the last
pipeline stage) and every parameter gradient gathered to TP=1 shape under its global name.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from prefix_sharing import PrefixSharingConfig
from prefix_sharing.testing.equivalence import max_rel_diff, pg_loss, plain_token_log_probs
from prefix_sharing.testing.workloads import make_workload

from ._distributed import _global_name, full_grads, load_full_state, tiny_gpt

VOCAB = 128
SHARE_EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)
PLAIN = PrefixSharingConfig(mode="off")

# Micro-batches of every sharing shape; token ids below the tiny models' vocabulary.
WORKLOADS = {
    "grpo": dict(num_prompts=2, group_size=3),
    "steprl": dict(num_chains=1, num_steps=4),
    "tree": dict(depth=2, branching=2),
    "none": dict(num_sequences=4),
}


def micro_batches(names: list[str] = list(WORKLOADS)) -> list[list[torch.Tensor]]:
    return [make_workload(n, vocab_size=VOCAB, seed=i, **WORKLOADS[n]).sequences
            for i, n in enumerate(names)]


def random_full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Seeded TP=1-shaped weights, by global parameter name (the same on every rank and stage).

    Norm weights near 1, everything else small: a model whose outputs depend on every part.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    state = {}
    for name, param in model.named_parameters():
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= tp
        name = _global_name(model, name)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        values = torch.randn(shape, generator=gen)
        is_norm = "norm" in name and name.endswith("weight")
        state[name] = (1 + 0.1 * values) if is_norm else 0.05 * values
    return state


def build(spec: Any, **model_overrides: Any) -> torch.nn.Module:
    """A tiny GPTModel with seeded weights (:func:`random_full_state`).

    ``spec``: ``"ours"`` (the prefix-sharing local spec), ``"stock"`` (megatron's), or a layer
    ``ModuleSpec``. Defaults: RMSNorm, SwiGLU, no biases, 4 query heads over 2 K/V groups.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec as stock_spec

    from prefix_sharing.megatron_ext import get_gpt_layer_local_spec as our_spec

    config = dict(num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
                  activation_func=torch.nn.functional.silu, add_bias_linear=False)
    config.update(model_overrides)
    if isinstance(spec, str):
        spec = (our_spec if spec == "ours" else stock_spec)(
            normalization=config["normalization"], qk_layernorm=config.get("qk_layernorm", False)
        )
    _, model = tiny_gpt(vocab_size=VOCAB, transformer_layer_spec=spec, **config)
    load_full_state(model, random_full_state(model))
    return model


def loss_weights(num_tokens: int, seed: int) -> torch.Tensor:
    """Per-token advantages, as a GRPO loss would weight the log-probs."""
    return torch.randn(num_tokens, generator=torch.Generator().manual_seed(seed))


def run(model: torch.nn.Module, batches: list[list[torch.Tensor]], kind: str,
        config: PrefixSharingConfig = SHARE_EVERY_PREFIX) -> dict[str, Any]:
    """Forward+backward of all micro-batches through megatron's schedule; see the module doc."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from prefix_sharing.megatron_ext import prepare_micro_batch, token_stats

    model.zero_grad(set_to_none=True)
    if kind == "stock":
        inputs = [_padded(seqs) for seqs in batches]
    else:
        inputs = [prepare_micro_batch(seqs, PLAIN if kind == "identity" else config,
                                      device="cpu") for seqs in batches]
    results: list[dict[str, torch.Tensor]] = []
    step = iter(range(len(batches)))

    def forward_step(data_iterator, model):
        i = next(step)
        seqs, mb = batches[i], next(data_iterator)
        if kind == "stock":
            tokens, positions = mb
            output = model(tokens, positions, None)
        else:
            output = model(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed_seq_params)

        def loss_func(logits):
            if kind == "stock":
                packed = _unpad(_gather_vocab(logits), seqs)
                log_probs, entropy = plain_token_log_probs(packed, seqs)
            else:
                stats = token_stats(logits, mb)
                packed = mb.plan.restore(_gather_vocab(logits)[0])
                log_probs, entropy = stats.log_probs, stats.entropy
            weights = loss_weights(log_probs.numel(), seed=i)
            loss = pg_loss(log_probs, entropy, weights)
            results.append(dict(logits=packed.detach(), log_probs=log_probs.detach(),
                                entropy=entropy.detach(), loss=loss.detach().clone()))
            return loss, {}

        return output, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(inputs), model=[model],
        num_microbatches=len(inputs), seq_length=max(max(len(s) for s in b) for b in batches),
        micro_batch_size=1,
    )
    digests = [] if kind == "stock" else [mb.plan.digest() for mb in inputs]
    return {"outputs": results, "grads": full_grads(model), "digests": digests}


def compare(candidate: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """Largest relative difference per quantity, over all micro-batches and parameters."""
    diffs = {"grads": max(max_rel_diff(candidate["grads"][k], g)
                          for k, g in reference["grads"].items())}
    for quantity in ("logits", "log_probs", "entropy", "loss"):
        diffs[quantity] = max(
            (max_rel_diff(c[quantity], r[quantity])
             for c, r in zip(candidate["outputs"], reference["outputs"])),
            default=0.0,
        )
    return diffs


def _padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[b, s]`` tokens and positions; causal attention keeps pads out of reach."""
    longest = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, s in enumerate(seqs):
        tokens[row, : len(s)] = s
    return tokens, torch.arange(longest).expand(len(seqs), longest)


def _unpad(logits: torch.Tensor, seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([logits[row, : len(s)] for row, s in enumerate(seqs)])


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits from this TP rank's slice (differentiable)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)
