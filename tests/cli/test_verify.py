"""prefix-sharing verify: the JSON contract, the verdict, and one-line errors for bad input."""

import json

import pytest

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.cli import main
from prefix_sharing.workloads import make_workload

QUANTITIES = {"logits", "log_probs", "entropy", "loss", "grads"}


def verify(capsys, *argv):
    code = main(["verify", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_report_of_a_shared_grpo_batch(capsys):
    code, out, _ = verify(capsys, "--workload", "grpo", "--json")
    report = json.loads(out)  # exactly one JSON object on stdout
    assert code == 0 and report["passed"] is True
    for key in ("max_rel_diff", "max_abs_diff", "plain_max_rel_diff", "allowed_rel_diff",
                "vs_plain_max_rel_diff", "within_tolerance"):
        assert set(report[key]) == QUANTITIES, key
    # fp32 is judged against the plain run in float64, whose own fp32 error is measured
    assert report["reference_dtype"] == "float64"
    assert report["plain_max_rel_diff"]["logits"] > 0
    assert all(report["max_rel_diff"][q] <= report["allowed_rel_diff"][q] for q in QUANTITIES)
    # ...and the fixed 1e-5 figure against the plain fp32 run is still reported
    assert report["vs_plain_within_fp32_rtol"] is True
    assert report["tokens_unique"] < report["tokens_total"]  # something was shared
    assert report["same_plan_on_every_rank"]
    assert (report["dtype"], report["backend"]) == ("float32", "auto")


def test_file_input_under_tensor_parallelism_in_bf16(capsys, tmp_path):
    prompt = list(range(1, 20))
    rows = [{"input_ids": prompt + [30 + i, 40 + i, 50]} for i in range(4)]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, _ = verify(capsys, "--sequences", path, "--tp", "2", "--dtype", "bfloat16", "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"], report
    assert report["tp"] == 2 and report["dtype"] == "bfloat16"
    assert report["reference_dtype"] == "float32"
    assert report["plain_max_rel_diff"]["logits"] > 0  # judged against the plain bf16 error
    assert (report["tokens_total"], report["tokens_unique"]) == (88, 19 + 4 * 3)


def test_moe_under_tensor_parallelism_passes_on_every_release(capsys):
    """``verify --model tiny-moe --tp 2``: router statistics under TP + sequence parallelism,
    shared vs megatron's stock spec (on megatron-core 0.19.2 the stock router was left in place
    by a partial-form MoE spec before, and the router gradients were off by 5e-1)."""
    code, out, _ = verify(capsys, "--model", "tiny-moe", "--tp", "2", "--workload", "grpo",
                          "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"], report
    assert report["tp"] == 2 and report["tokens_unique"] < report["tokens_total"]
    assert report["max_rel_diff"]["grads"] <= report["allowed_rel_diff"]["grads"]


def test_text_report_names_every_quantity(capsys):
    code, out, _ = verify(capsys, "--workload", "tree", "--pp", "2", "--steps", "2",
                          "--backend", "torch")
    assert code == 0
    assert "PASSED" in out and all(q in out for q in QUANTITIES)
    assert "torch attention" in out and "plain run in float64" in out


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "--tp 3 does not divide the tiny preset"),
    (["--pp", "3"], "--pp 3 does not divide the tiny preset's 2 layers"),
    (["--tp", "8", "--pp", "8"], "tp x pp x cp = 64 ranks, but at most"),
    (["--tp", "0"], "--tp, --pp and --cp must be at least 1"),
    (["--cp", "2", "--steps", "2"], "--steps 2 with --cp 2"),
    (["--dtype", "fp16"], "--dtype must be one of float32, bfloat16"),
    (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--workload", "forest"], "unknown workload 'forest'"),
    (["--engine", "deepspeed"], "unknown engine 'deepspeed'"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--backend", "cudnn"], "PrefixSharingConfig.backend must be one of"),
    (["--mode", "sometimes"], "PrefixSharingConfig.mode must be one of"),
    (["--sequences", "/nonexistent/rollouts.jsonl"], "rollouts.jsonl"),
])
def test_bad_input_is_one_line_on_stderr(capsys, argv, message):
    code, out, err = verify(capsys, *argv)
    assert code != 0 and out == ""
    assert err.startswith("prefix-sharing verify: error:") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_context_parallel_agent_batch_in_float32(capsys):
    code, out, _ = verify(capsys, "--workload", "agent", "--cp", "2", "--min-prefix-len", 1,
                          "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] is True, report
    assert report["cp"] == 2 and report["same_plan_on_every_rank"]
    assert report["vs_plain_within_fp32_rtol"] is True
    assert report["tokens_unique"] < report["tokens_total"]


def test_a_random_weight_preset_grows_its_vocabulary_to_the_data(capsys, tmp_path):
    """A rollout dump from a real tokenizer has ids far beyond tiny's 512: with random weights
    the vocabulary is free, so it is sized to the data (rounded up to 128 x tp, as
    Megatron-LM pads it)."""
    path = tmp_path / "big.jsonl"
    rows = [{"input_ids": [1, 2, 3, 3997 + i]} for i in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    code, out, err = verify(capsys, "--sequences", path, "--tp", "2", "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"], err
    assert report["model"] == "tiny" and report["vocab_size"] == 4096  # 4000 -> 16 x 256


def test_a_preset_with_a_real_vocabulary_refuses_ids_beyond_it(capsys, tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2, 200000]}) + "\n")
    code, _, err = verify(capsys, "--sequences", path, "--model", "qwen2.5-0.5b")
    assert code == 2
    assert "token id 200000 is outside the qwen2.5-0.5b preset's vocabulary of 151936" in err


@pytest.mark.parametrize("engine, model, workload", [
    ("megatron", "tiny-window", "steprl"),  # windows of 16 against a 40-token chain, sinks
    ("hf", "tiny-window", "agent"),  # gpt-oss: sinks, MoE, YaRN
    ("hf", "tiny-gemma3", "tree"),
    ("hf", "tiny-gemma4", "grpo"),
])
def test_windowed_presets_pass(capsys, engine, model, workload):
    code, out, _ = verify(capsys, "--engine", engine, "--model", model, "--workload", workload,
                          "--min-prefix-len", 1, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] is True and report["model"] == model
    assert report["tokens_unique"] < report["tokens_total"]


def test_token_budget_runs_each_group_across_micro_batches_with_its_prefix_once(capsys):
    """On the MoE preset (aux, seq-aux, global-aux losses, z-loss), judged against the plain
    run of the same samples in the same micro-batches (the dense path: the TP test below)."""
    code, out, _ = verify(capsys, "--model", "tiny-moe", "--workload", "grpo", "--token-budget",
                          30, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and all(report["within_tolerance"].values())
    assert report["token_budget"] == 30 and report["prefix_lens"] == [15, 21, 13]
    # 3 groups, each its prompt and 2 suffix micro-batches of at most 30 computed tokens
    assert report["num_micro_batches"] == 9 and report["prefix_recomputes_avoided"] == 3
    assert report["tokens_computed"] == report["tokens_unique"] < report["tokens_total"]
    assert report["held_bytes"] > 0 and report["vs_plain_within_fp32_rtol"]


def test_token_budget_under_tensor_parallelism(capsys):
    code, out, _ = verify(capsys, "--workload", "agent", "--token-budget", 60, "--tp", 2, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and report["tp"] == 2
    assert report["num_micro_batches"] > 2 * len(report["prefix_lens"])


def test_token_budget_under_context_parallelism(capsys):
    """Every block and suffix split over 2 CP ranks, against the stock step on the same split
    at CP=1: two groups, their sub-trees with shared blocks of their own."""
    code, out, _ = verify(capsys, "--workload", "agent", "--token-budget", 60, "--cp", 2, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and report["cp"] == 2, report
    assert report["num_shared_blocks"] > len(report["prefix_lens"]) == 2
    assert report["vs_plain_within_fp32_rtol"]


@pytest.mark.parametrize("argv, recompute", [
    # the long-context combination: MoE (router losses) at TP=2 with sequence parallelism
    (["--model", "tiny-moe", "--workload", "grpo", "--tp", "2", "--token-budget", 30], "full"),
    (["--workload", "agent", "--token-budget", 60], "selective"),
    # windows of 16 on every other layer against 34-token prefixes, sinks (megatron's stock
    # windowed softmax builds its mask on "cuda" when recomputed: no recompute here on CPU)
    (["--model", "tiny-window", "--workload", "agent", "--token-budget", 60], None),
])
def test_token_budget_with_recompute_tensor_parallelism_moe_and_windows(capsys, argv,
                                                                        recompute):
    """Every model of the run (shared, plain, reference) with the same recompute setting."""
    extra = [] if recompute is None else ["--recompute", recompute]
    code, out, _ = verify(capsys, *argv, *extra, "--min-prefix-len", 1, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and all(report["within_tolerance"].values()), report
    assert report["recompute"] == recompute and report["vs_plain_within_fp32_rtol"]
    assert report["prefix_recomputes_avoided"] > 0
@pytest.mark.parametrize("budget, shape", [
    (12, "a common prefix of about 3 budgets"),  # prefixes 34 and 36: 3 chunks, then sub-trees
    (40, "a two-level tree"),  # each prefix in one block, each group's 2 branches in theirs
])
def test_token_budget_computes_each_prefix_once_nested(capsys, budget, shape):
    code, out, _ = verify(capsys, "--workload", "agent", "--min-prefix-len", 1,
                          "--token-budget", budget, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and all(report["within_tolerance"].values()), shape
    assert report["prefix_lens"] == [34, 36] and report["max_tokens_computed"] <= budget
    # each group's every token once (the two groups' common system prompt once per group)
    w = make_workload("agent")
    per_group = sum(build_plan([w.sequences[i] for i in g.members],
                               PrefixSharingConfig(min_prefix_len=1)).num_tokens_unique
                    for g in w.groups)
    assert report["tokens_computed"] == per_group < report["tokens_total"]
    assert report["recomputed_tokens"] == 0 and report["vs_plain_within_fp32_rtol"]
    # more shared blocks than groups: chunks of the prefixes, or the branches' own
    assert report["num_shared_blocks"] >= 3 * len(report["prefix_lens"])


def test_token_budget_on_moe_with_chunked_prompts(capsys):
    """tiny-moe with router statistics at --tp 1, prompts of 15 and 21 tokens under 12."""
    code, out, _ = verify(capsys, "--model", "tiny-moe", "--workload", "grpo", "--token-budget",
                          12, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and all(report["within_tolerance"].values())
    assert max(report["prefix_lens"]) > 12 and report["max_tokens_computed"] <= 12
    assert report["tokens_computed"] == report["tokens_unique"]
    assert report["num_shared_blocks"] > len(report["prefix_lens"])


def test_token_budget_under_pipeline_parallelism(capsys):
    """PP=2: each group's prompt a block of its own, computed without grad before its suffix
    micro-batches and again with grad after them (its backward step): computed twice."""
    code, out, _ = verify(capsys, "--workload", "grpo", "--token-budget", 44, "--pp", 2, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and all(report["within_tolerance"].values())
    assert report["pp"] == 2 and report["vs_plain_within_fp32_rtol"]
    assert report["num_micro_batches"] >= 2 * len(report["prefix_lens"])  # a block, suffixes
    assert report["recomputed_tokens"] == sum(report["prefix_lens"])
    assert report["tokens_computed"] == report["tokens_unique"] + sum(report["prefix_lens"])
    assert report["max_tokens_computed"] <= 44


def test_token_budget_under_pipeline_parallelism_with_prompts_in_chunks(capsys):
    """PP=2, prompts of 15 and 21 tokens under 12: each group's prompt in chunks, its steps
    (each chunk without grad, the suffixes, each chunk again with grad) micro-batches of their
    own; every chunk computed twice."""
    code, out, _ = verify(capsys, "--workload", "grpo", "--token-budget", 12, "--pp", 2,
                          "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and all(report["within_tolerance"].values())
    assert report["num_shared_blocks"] > len(report["prefix_lens"])  # chunked prompts
    # every block (the prompts' chunks, and sub-trees' blocks) computed twice
    assert report["recomputed_tokens"] > sum(report["prefix_lens"])
    assert report["tokens_computed"] == report["tokens_unique"] + report["recomputed_tokens"]
    assert report["max_tokens_computed"] <= 12


@pytest.mark.parametrize("argv, message", [
    (["--token-budget", "30", "--cp", "2", "--pp", "2"],
     "--token-budget (cross-micro-batch sharing) runs"),
])
def test_token_budget_refusals_are_one_line(capsys, argv, message):
    code, out, err = verify(capsys, "--workload", "grpo", *argv)
    assert code != 0 and out == "" and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_routing_replay_with_a_route_diverging_inside_a_shared_prefix(capsys):
    """Two pipeline stages: each replays its own layers' routes from the plan."""
    code, out, _ = verify(capsys, "--model", "tiny-moe", "--routing-replay", "--workload", "tree",
                          "--min-prefix-len", 1, "--pp", 2, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"], report
    assert report["routing_replay"] and report["route_diverged_at"] is not None and report["pp"] == 2
    assert report["route_divergent_prefix_tokens"] > 0
    assert report["vs_plain_within_fp32_rtol"] and report["tokens_unique"] < report["tokens_total"]


@pytest.mark.parametrize("tp", [1, 2])
def test_routing_replay_across_micro_batches(capsys, tp):
    """A route changed inside a prompt: that group's schedule cuts its common prefix there;
    each prefix of tokens and routes computed once, judged against the stock replay (at
    --tp 2 with sequence parallelism, each rank replaying its slices)."""
    code, out, _ = verify(capsys, "--model", "tiny-moe", "--workload", "grpo", "--routing-replay",
                          "--token-budget", 30, "--tp", tp, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] and report["vs_plain_within_fp32_rtol"], report
    _, position = report["route_diverged_at"]
    assert position in report["prefix_lens"] and report["route_divergent_prefix_tokens"] > 0
    assert report["tokens_computed"] == report["tokens_unique"] < report["tokens_total"]


def test_routing_replay_needs_an_moe_preset(capsys):
    code, out, err = verify(capsys, "--routing-replay")
    assert code != 0 and out == ""
    assert "--routing-replay replays MoE routes on the megatron engine" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("layout", [("--tp", 2), ("--pp", 2)], ids=["cp2-tp2", "cp2-pp2"])
def test_multi_latent_attention_moe_under_context_parallelism_with_tp_or_pp(capsys, layout):
    """tiny-mla (MLA + MoE with a dense first layer) at CP=2 x TP=2 and CP=2 x PP=2 on four
    ranks against the plain runs at CP=1: the tree micro-batch, every quantity in tolerance."""
    code, out, _ = verify(capsys, "--model", "tiny-mla", "--workload", "tree", "--cp", 2,
                          *layout, "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"] is True, report
    assert report["cp"] == 2 and report[layout[0].lstrip("-")] == 2
    assert report["vs_plain_within_fp32_rtol"] is True and report["same_plan_on_every_rank"]
    assert report["tokens_unique"] < report["tokens_total"]
