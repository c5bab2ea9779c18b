"""A group across micro-batches on a transformers model, its steps in a plain loop
(``HFGroupSteps``): every token's logits, log-probs and entropy, the loss and every gradient
equal transformers' own forward of the whole batch, sequence by sequence - one level (the
prefix's graph kept from its forward step to its backward step) and nested (chunks and
sub-tree blocks, each computed again in its backward step), with and without transformers'
gradient checkpointing (non-reentrant, as verl turns it on). A control whose block backward
steps drop their readers' gradients fails."""

import pytest
import torch

from prefix_sharing.cross_micro_batch import plan_group
from prefix_sharing.equivalence import RunOutputs, advantages, compare_pairs, pg_loss
from prefix_sharing.fsdp_compat.cross_steps import HFGroupSteps, block_log_probs
from prefix_sharing.fsdp_compat.runs import plain_run
from prefix_sharing.logprobs import token_log_probs
from prefix_sharing.workloads import agent
from tests.fsdp_compat._models import EVERY_PREFIX, plain_and_shared
from tests.megatron_ext._controls import blocks_take_no_gradients

WORKLOAD = agent(num_tasks=1, num_turns=3, branching=2, system_len=24, vocab_size=101)
SETTINGS = {"one level": dict(budget=64, one_level=True),
            "nested": dict(budget=30, one_level=False)}


def cross_run(model: torch.nn.Module, budget: int, one_level: bool,
              training: bool = True) -> tuple[RunOutputs, HFGroupSteps]:
    """The workload as one group across micro-batches: block steps by ``HFGroupSteps``, each
    suffix micro-batch's loss over its samples' tokens (its blocks' positions read from their
    leaves, its tails' from its own logits) backpropagated before the next."""
    sequences = WORKLOAD.sequences
    schedule = plan_group(sequences, budget, EVERY_PREFIX, one_level=one_level)
    total = sum(len(s) for s in sequences)
    weights = advantages(total, seed=0)
    dtype = model.dtype
    logits = torch.zeros(total, model.config.vocab_size, dtype=dtype)
    log_probs, entropy = torch.zeros(total, dtype=dtype), torch.zeros(total, dtype=dtype)

    def read_out(block, rows):
        if torch.is_grad_enabled() == steps.keep_graph:  # the forward step: keep its logits
            flat = block.stats_plan.restore(block.scored_rows(rows.detach()))
            logits[block.positions] = flat.index_select(0, block.scored_positions())
        return block_log_probs(block, rows, temperature=1.0, with_entropy=True)

    steps = HFGroupSteps(schedule, lambda inputs: model(**inputs).logits[0], read_out,
                         keep_graph=one_level, training=training, backend="torch",
                         device=torch.device("cpu"))
    model.zero_grad(set_to_none=True)
    loss = torch.zeros(())
    for j, suffix in enumerate(schedule.suffixes):
        rows = model(**steps.suffix_kwargs(j)).logits[0]
        tails = token_log_probs(rows, suffix.tail_plan, with_entropy=True)
        heads = steps.heads(0, j, list(suffix.members))
        # the block positions of its members, member-major as the heads hold them
        at = [torch.cat([schedule.blocks[r].positions.view(len(schedule.blocks[r].members), -1)
                         [schedule.blocks[r].members.index(m)] for r in suffix.reads])
              for m in suffix.members]
        positions = torch.cat([torch.cat(at), suffix.token_positions])
        lp = torch.cat([heads[0].reshape(-1), tails.log_probs])
        ent = torch.cat([heads[1].reshape(-1), tails.entropy])
        # pg_loss is a sum of per-token terms: each micro-batch's share over the whole count
        term = (-(weights[positions] * lp).sum() / total - 0.01 * ent.sum() / total)
        if training:
            term.backward()
        loss = loss + term.detach()
        log_probs[positions], entropy[positions] = lp.detach(), ent.detach()
        logits[suffix.token_positions] = suffix.tail_plan.restore(rows.detach())
    steps.finish()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return RunOutputs(logits, log_probs, entropy, loss, grads), steps


@pytest.fixture(scope="module")
def models():
    return plain_and_shared("qwen2", dtype=torch.float64)


@pytest.fixture(scope="module")
def plain(models):
    weights = advantages(WORKLOAD.num_tokens, seed=0)
    return plain_run(models[0], WORKLOAD.sequences, weights)


def compare(run: RunOutputs, plain: RunOutputs):
    pairs = {q: [(run.get(q), plain.get(q))] for q in ("logits", "log_probs", "entropy", "loss")}
    pairs["grads"] = [(run.grads[k], g) for k, g in plain.grads.items()]
    assert set(run.grads) == set(plain.grads)
    return compare_pairs(pairs)


def test_the_plain_loss_is_the_sum_of_the_micro_batches_terms(plain):
    weights = advantages(WORKLOAD.num_tokens, seed=0)
    assert torch.allclose(plain.loss, pg_loss(plain.log_probs, plain.entropy, weights))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_a_group_across_micro_batches_equals_transformers_forward(models, plain, setting,
                                                                  checkpointing):
    model = models[1]
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        run, steps = cross_run(model, **SETTINGS[setting])
    finally:
        model.gradient_checkpointing_disable()
    schedule = steps.schedule
    assert len(schedule.suffixes) > 1  # the group runs across micro-batches
    assert (len(schedule.blocks) > 1) == (setting == "nested")
    assert steps.recomputed_tokens == (0 if setting == "one level"
                                       else sum(b.length for b in schedule.blocks))
    # float64: the one-micro-batch shared forward's own gradients differ from transformers' by
    # up to 2e-7 relative on this batch (its outputs by 1e-15); a dropped share is over 1e-3
    for quantity, diff in compare(run, plain).max_rel_diff.items():
        assert diff < (1e-6 if quantity == "grads" else 1e-12), (setting, quantity, diff)


@pytest.mark.parametrize("setting", SETTINGS)
def test_blocks_that_take_no_gradients_fail(models, plain, setting):
    with blocks_take_no_gradients():
        run, _ = cross_run(models[1], **SETTINGS[setting])
    assert compare(run, plain).max_rel_diff["grads"] > 1e-3


def test_a_forward_only_run_computes_each_block_once_without_grad(models, plain):
    with torch.no_grad():
        run, steps = cross_run(models[1], **SETTINGS["nested"], training=False)
    assert steps.recomputed_tokens == 0 and not run.grads
    for quantity in ("logits", "log_probs", "entropy"):
        assert torch.allclose(run.get(quantity), plain.get(quantity), rtol=1e-9, atol=1e-12)


def test_suffix_micro_batches_run_once_each_in_order(models):
    schedule = plan_group(WORKLOAD.sequences, 20, EVERY_PREFIX)

    def steps():
        return HFGroupSteps(schedule, lambda inputs: models[1](**inputs).logits[0],
                            lambda block, rows: (rows[:1], None), keep_graph=False,
                            training=False, backend="torch", device=torch.device("cpu"))

    with torch.no_grad():
        with pytest.raises(RuntimeError, match="micro-batch 0 .* did not run"):
            steps().suffix_kwargs(1)
        first = steps()
        first.suffix_kwargs(0)
        with pytest.raises(RuntimeError, match="runs again"):
            first.suffix_kwargs(0)
