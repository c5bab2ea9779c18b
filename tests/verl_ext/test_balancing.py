"""verl's real ``_balance_batch`` with sharing on keeps every group on one rank, balanced by
computed cost (``prefix_sharing.verl_ext.balancing``); with sharing off or
``balance_batch: false`` it is verl's own, order for order.

Both trainers at dp = 8: the legacy one (verl 0.8.0, 0.9's ``use_v1: false``) on a padded
``DataProto``, and 0.9's v1 one on a batch in TransferQueue (a fake client with TransferQueue's
own packing: ``_trainer``). Batches: GRPO, 64 prompts x 8 responses (prompts 100-400 tokens,
responses 50-1000, random tokens); a tree batch (64 trees of 8 root-to-leaf paths, each
level its own tokens). What is measured is recomputed here from plans of the ranks' chunks
(verl deals the reordered batch in equal contiguous chunks), not read from the partition.
"""

import importlib.util

import pytest

from tests.verl_ext._requires import require_verl

require_verl(("0.9.1", "0.8.0"))

import torch  # noqa: E402

from tests.verl_ext import _trainer  # noqa: E402
from prefix_sharing.batching import computed_cost  # noqa: E402
from prefix_sharing.config import PrefixSharingConfig  # noqa: E402
from prefix_sharing.planner import build_plan, prompt_groups  # noqa: E402

DP, N, PROMPTS, MINI_BATCH_PROMPTS = 8, 8, 64, 16
ARBITRARY = {"mode": "arbitrary_prefix"}
PROMPT_ONLY = {"mode": "prompt_only"}
HAS_V1 = importlib.util.find_spec("verl.trainer.ppo.v1") is not None and \
    importlib.util.find_spec("transfer_queue") is not None
TRAINERS = ["legacy"] + (["v1"] if HAS_V1 else [])


def grpo_batch(seed: int = 0, prompts: int = PROMPTS):
    """(prompts, responses, uids) per sample: ``prompts`` groups of N sharing their prompt."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=gen))  # noqa: E731
    tokens = lambda k: torch.randint(3, 32000, (k,), generator=gen)  # noqa: E731
    out = ([], [], [])
    for g in range(prompts):
        prompt = tokens(rand(100, 400))
        for _ in range(N):
            for column, value in zip(out, (prompt, tokens(rand(50, 1000)), f"p{g}")):
                column.append(value)
    return out


def tree_batch(seed: int = 1):
    """64 trees, 3 binary levels below a 100-400 token root: 8 paths each; the prompt is the
    root, the response every level below it (20-300 tokens each)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=gen))  # noqa: E731
    tokens = lambda k: torch.randint(3, 32000, (k,), generator=gen)  # noqa: E731
    out = ([], [], [])
    for t in range(PROMPTS):
        root = tokens(rand(100, 400))
        paths = [torch.empty(0, dtype=torch.long)]
        for _ in range(3):
            paths = [torch.cat([p, tokens(rand(20, 300))]) for p in paths for _ in range(2)]
        for path in paths:
            for column, value in zip(out, (root, path, f"t{t}")):
                column.append(value)
    return out


def run_balance(kind, sharing, samples, monkeypatch, *, balance_batch=True, stock=False):
    """verl's trainer of ``kind`` balances ``samples``; returns (per-sample uid, sequence in
    the new order; the metrics dict). ``stock``: call verl's function itself, unpatched."""
    prompts, responses, uids = samples
    config = _trainer.trainer_config(sharing=sharing, dp=DP, n=N,
                                     mini_batch_prompts=MINI_BATCH_PROMPTS,
                                     balance_batch=balance_batch)
    metrics = {}
    if kind == "legacy":
        trainer = _trainer.legacy_trainer(config, DP)
        batch = _trainer.legacy_batch(prompts, responses, uids)
        balance = type(trainer)._balance_batch
        (balance.__wrapped__ if stock else balance)(trainer, batch, metrics)
        mask = batch.batch["attention_mask"].bool()
        sequences = [ids[m] for ids, m in zip(batch.batch["input_ids"], mask)]
        prompt_lens = mask[:, : batch.batch["prompts"].size(1)].sum(-1).tolist()
        return list(batch.non_tensor_batch["uid"]), sequences, prompt_lens, metrics
    fake = _trainer.FakeTransferQueue()
    fake.install(monkeypatch)
    trainer = _trainer.v1_trainer(config, DP)
    batch = _trainer.v1_batch(fake, prompts, responses, uids)
    balance = type(trainer)._balance_batch
    batch = (balance.__wrapped__ if stock else balance)(trainer, batch, metrics)
    data = fake.kv_batch_get(batch.keys, batch.partition_id, ["input_ids", "uid"])
    return (list(data["uid"]), list(data["input_ids"].unbind()),
            [tag["prompt_len"] for tag in batch.tags], metrics)


def rank_figures(uids, sequences, prompt_lens, mode):
    """Per rank (equal contiguous chunks): tokens computed and cost of its plan; the ideal's
    tokens (each group's plan alone)."""
    config = PrefixSharingConfig(mode=mode)

    def plan(members):
        groups = (prompt_groups([uids[i] for i in members], [prompt_lens[i] for i in members])
                  if mode == "prompt_only" else None)
        return build_plan([sequences[i] for i in members], config, groups=groups)

    size = len(sequences) // DP
    plans = [plan(range(r * size, (r + 1) * size)) for r in range(DP)]
    ideal = sum(plan([i for i, u in enumerate(uids) if u == g]).num_tokens_unique
                for g in dict.fromkeys(uids))
    total = sum(len(s) for s in sequences)
    return {"token_ratio": total / sum(p.num_tokens_unique for p in plans),
            "ideal_token_ratio": total / ideal,
            "cost_imbalance": max(c := [computed_cost(p) for p in plans]) * DP / sum(c)}


def ranks_of_groups(uids):
    size = len(uids) // DP
    ranks = {}
    for i, uid in enumerate(uids):
        ranks.setdefault(uid, set()).add(i // size)
    return ranks


CASES = [("grpo", ARBITRARY), ("grpo", PROMPT_ONLY), ("tree", ARBITRARY)]


@pytest.mark.parametrize("kind", TRAINERS)
@pytest.mark.parametrize("workload, sharing", CASES)
def test_sharing_keeps_each_group_on_one_rank_balanced_by_computed_cost(kind, workload,
                                                                       sharing, monkeypatch):
    samples = {"grpo": grpo_batch, "tree": tree_batch}[workload]()
    uids, sequences, prompt_lens, metrics = run_balance(kind, sharing, samples, monkeypatch)
    before = sorted(tuple(torch.cat([p, r]).tolist()) for p, r, _ in zip(*samples))
    assert sorted(tuple(s.tolist()) for s in sequences) == before  # none lost or duplicated
    assert all(len(ranks) == 1 for ranks in ranks_of_groups(uids).values())
    mini = MINI_BATCH_PROMPTS * N // DP  # each rank's mini-batches hold whole groups
    assert all(len({uids[i] for i in range(s, s + mini)}) == mini // N
               for s in range(0, len(uids), mini))
    figures = rank_figures(uids, sequences, prompt_lens, sharing["mode"])
    assert figures["cost_imbalance"] <= 1.05, figures
    assert figures["token_ratio"] >= 0.98 * figures["ideal_token_ratio"], figures
    for key, value in figures.items():  # what the trainer logs is what the ranks compute
        assert metrics[f"prefix_sharing/dp_{key}"] == pytest.approx(value, rel=1e-9), key
    assert "global_seqlen/balanced_max" in metrics  # verl's own figures are still logged


@pytest.mark.parametrize("kind", TRAINERS)
@pytest.mark.parametrize("sharing, balance_batch", [(None, True), (ARBITRARY, False)])
def test_sharing_off_or_balance_batch_false_is_verls_own_order(kind, sharing, balance_batch,
                                                               monkeypatch):
    samples = grpo_batch()
    ours = run_balance(kind, sharing, samples, monkeypatch, balance_batch=balance_batch)
    verls = run_balance(kind, sharing, samples, monkeypatch, balance_batch=balance_batch,
                        stock=True)
    assert [s.tolist() for s in ours[1]] == [s.tolist() for s in verls[1]]
    assert ours[3] == verls[3]
    assert not any(key.startswith("prefix_sharing/") for key in ours[3])


@pytest.mark.skipif(not HAS_V1, reason="verl 0.9's v1 trainer and TransferQueue")
def test_v1_padding_samples_fill_the_ranks_and_groups_stay_whole(monkeypatch):
    samples = grpo_batch(prompts=PROMPTS - 1)  # 504 samples: verl pads to 512
    uids, sequences, _, metrics = run_balance("v1", ARBITRARY, samples, monkeypatch)
    assert len(uids) == PROMPTS * N
    real = {u: r for u, r in ranks_of_groups(uids).items() if not u.startswith("pad")}
    assert len(real) == PROMPTS - 1 and all(len(r) == 1 for r in real.values())
    assert metrics["prefix_sharing/dp_cost_imbalance"] <= 1.05


def test_the_stock_ratio_verl_gives_the_same_batch(monkeypatch):
    """The figure sharing-aware balancing is measured against: verl's stock order."""
    samples = grpo_batch()
    uids, sequences, prompt_lens, _ = run_balance(TRAINERS[-1], None, samples, monkeypatch)
    stock = rank_figures(uids, sequences, prompt_lens, "arbitrary_prefix")
    ours = rank_figures(*run_balance(TRAINERS[-1], ARBITRARY, samples, monkeypatch)[:3],
                        "arbitrary_prefix")
    print(f"\nstock {stock}\nsharing-aware {ours}")
    assert stock["token_ratio"] < 0.9 * ours["token_ratio"]
