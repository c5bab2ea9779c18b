"""verl 0.9.1's real Megatron engine with ``prefix_grouper`` on gives what it gives with it off.

Old log-probs and entropy (``infer_batch``), verl's ``ppo_loss`` (with entropy and KL terms) and
every gradient (``forward_backward_batch``), on GRPO, step-wise, tree and agent batches, one
process, tensor-parallel 2, pipeline-parallel 2, and pipeline-parallel 2 with two virtual stages
per rank (verl's interleaved schedule; gloo; every rank plans the micro-batch, every model chunk
runs it with its own plan). The last position of each sample predicts nothing (verl
fills it from a wrapped-around label; downstream reads stop before it) and is not compared for
log-probs.
"""

import importlib.util
from functools import partial

import pytest

from tests.verl_ext._requires import require_verl

require_verl("0.9.1")

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._batch import WORKLOADS, make_batch  # noqa: E402
from tests.verl_ext._engine import run  # noqa: E402

# pp2vpp2: verl's interleaved schedule, two model chunks per rank (a layer each), one
# micro-batch iterator per chunk (verl's make_batch_generator); micro-batches of 3 samples, a
# multiple of PP of them (verl asserts it): 4 of GRPO groups, 2 of the tree's 6 samples
INTERLEAVED_BATCHES = {"grpo": dict(micro_batch_size=3, num_prompts=4, group_size=3),
                       "tree": dict(micro_batch_size=3)}
LAYOUTS = {"tp1": (1, 1, None, {}), "tp2": (2, 1, None, {}), "pp2": (1, 2, None, {}),
           "pp2vpp2": (1, 2, 2, INTERLEAVED_BATCHES)}  # name: (tp, pp, vpp, batches)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def results(request):
    tp, pp, vpp, batches = LAYOUTS[request.param]
    workloads = list(WORKLOADS) if tp * pp == 1 else ["grpo", "tree"]
    modes = MODES if tp * pp == 1 else {k: MODES[k] for k in ("off", "arbitrary_prefix")}
    per_rank = run_distributed(partial(run, batches=batches), tp * pp, workloads, modes, tp=tp,
                               pp=pp, vpp=vpp, timeout=400)
    return request.param, workloads, modes, per_rank


def test_log_probs_entropy_loss_and_gradients_match_the_feature_off(results):
    layout, workloads, modes, per_rank = results
    for rank_result in per_rank:
        for workload in workloads:
            for mode in modes:
                if mode != "off":
                    same_outputs(rank_result[workload, mode], rank_result[workload, "off"],
                                 f"{layout} {workload} {mode}")


def test_sharing_metrics_reach_verls_metrics_dict(results):
    layout, workloads, modes, per_rank = results
    last_stage = per_rank[-1]
    for workload in workloads:
        plain = last_stage[workload, "off"]["train"]["metrics"]
        shared = last_stage[workload, "arbitrary_prefix"]["train"]["metrics"]
        assert not any(k.startswith("prefix_sharing/") for k in plain)
        total = shared["prefix_sharing/tokens_total"][0]
        computed = shared["prefix_sharing/tokens_computed"][0]
        assert computed < total, f"{workload}: nothing shared"
        # each sample's tokens once (under virtual stages a rank runs every micro-batch once
        # per model chunk)
        sizes = LAYOUTS[layout][3].get(workload, {})
        assert total == make_batch(workload, **sizes)["input_ids"].offsets()[-1], (layout, workload)
        assert shared["prefix_sharing/token_ratio"][0] == pytest.approx(total / computed)
        # verl's worker all-gathers each metric over DP ranks, then flattens a list (or
        # aggregates its own Metric objects): a bare number fails there
        assert all(isinstance(value, list) for key, value in shared.items()
                   if key.startswith("prefix_sharing/")), shared


def test_prompt_only_on_the_v1_trainers_batch_shares_and_matches_the_feature_off():
    # the v1 trainer's TransferQueue fields: nested prompts, no padded masks
    if importlib.util.find_spec("transfer_queue") is None:
        pytest.skip("verl 0.9's v1 trainer layout needs TransferQueue (verl's verl-core extra)")
    modes = {"off": None, "prompt_only": MODES["prompt_only"]}
    (got,) = run_distributed(partial(run, layout="v1"), 1, ["grpo"], modes, timeout=400)
    same_outputs(got["grpo", "prompt_only"], got["grpo", "off"], "v1 prompt_only")
    metrics = got["grpo", "prompt_only"]["train"]["metrics"]
    assert metrics["prefix_sharing/tokens_computed"][0] < metrics["prefix_sharing/tokens_total"][0]
