"""prefix-sharing analyze: the figures, sharing structure and prefix tree of a rollout file, and
the one-line errors for bad input."""

import json
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.cli import main
from prefix_sharing.cli.analyze import TREE_LIMIT, prefix_tree, sharing_structure
from prefix_sharing.flops import count_flops
from prefix_sharing.presets import PRESETS, get_preset
from tests.strategies import forests

EVERY_PREFIX = PrefixSharingConfig(min_prefix_len=1)

# Two GRPO prompts (10 and 12 tokens) with 3 responses each; responses start with distinct
# tokens, so only the prompts are shared.
PROMPTS = {"a": list(range(100, 110)), "b": list(range(200, 212))}
RESPONSE_LENS = {"a": [3, 4, 5], "b": [2, 6, 1]}
GRPO_ROWS = [
    {"uid": uid, "prompt_ids": PROMPTS[uid], "response_ids": list(range(1000 + 10 * k, 1000 + 10 * k + n))}
    for k, (uid, n) in enumerate((uid, n) for uid in "ab" for n in RESPONSE_LENS[uid])
]
GRPO_SEQUENCES = [row["prompt_ids"] + row["response_ids"] for row in GRPO_ROWS]
# 13 + 14 + 15 + 14 + 18 + 13 tokens; computed: each prompt once plus every response
GRPO_TOTAL, GRPO_UNIQUE = 87, 10 + 3 + 4 + 5 + 12 + 2 + 6 + 1

JSON_KEYS = {"file", "sequences", "tokens_total", "tokens_unique", "token_ratio", "flop_ratio",
             "planner_ms", "model", "mode", "min_prefix_len", "min_group_size", "structure"}
STRUCTURE_KEYS = {"sharing_groups", "largest_sharing_group", "longest_shared_prefix",
                  "deepest_reuse_chain", "sequences_computing_nothing"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def analyze(capsys, *argv):
    code = main(["analyze", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def analyze_json(capsys, *argv):
    code, out, err = analyze(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    return json.loads(out)


@pytest.fixture
def grpo_file(tmp_path):
    return write_jsonl(tmp_path / "grpo.jsonl", GRPO_ROWS)


# --------------------------------------------------------------------------- figures
def test_grpo_figures_match_the_hand_count(capsys, grpo_file):
    report = analyze_json(capsys, grpo_file)
    assert report["sequences"] == 6
    assert (report["tokens_total"], report["tokens_unique"]) == (GRPO_TOTAL, GRPO_UNIQUE)
    assert report["token_ratio"] == pytest.approx(GRPO_TOTAL / GRPO_UNIQUE)
    plan = build_plan(GRPO_SEQUENCES)
    assert report["flop_ratio"] == pytest.approx(count_flops(plan, get_preset("qwen2.5-0.5b")).ratio)
    assert report["flop_ratio"] > 1
    assert report["structure"] == {
        "sharing_groups": 2, "largest_sharing_group": 3, "longest_shared_prefix": 12,
        "deepest_reuse_chain": 1, "sequences_computing_nothing": 0,
    }


def test_options_default_to_the_config_defaults_and_qwen(capsys, grpo_file):
    report = analyze_json(capsys, grpo_file)
    assert (report["mode"], report["min_prefix_len"], report["min_group_size"]) == (
        "arbitrary_prefix", 8, 2)
    assert report["model"] == "qwen2.5-0.5b"


def test_json_prints_exactly_one_object_with_every_key(capsys, grpo_file):
    code, out, err = analyze(capsys, grpo_file, "--json", "--model", "tiny")
    assert (code, err) == (0, "")
    assert out.count("\n") == 1
    report = json.loads(out)
    assert set(report) == JSON_KEYS
    assert set(report["structure"]) == STRUCTURE_KEYS
    assert (report["file"], report["model"]) == (grpo_file, "tiny")
    assert isinstance(report["planner_ms"], float) and report["planner_ms"] >= 0


@pytest.mark.parametrize("options, tokens_unique, sharing_groups", [
    (["--min-prefix-len", "11"], 13 + 14 + 15 + 12 + 2 + 6 + 1, 1),  # prompt a is too short
    (["--min-group-size", "4"], GRPO_TOTAL, 0),  # groups of 3 are too small
    (["--mode", "off"], GRPO_TOTAL, 0),
    (["--mode", "prompt_only"], GRPO_UNIQUE, 2),
])
def test_options_change_what_is_shared(capsys, grpo_file, options, tokens_unique, sharing_groups):
    report = analyze_json(capsys, grpo_file, *options)
    assert report["tokens_unique"] == tokens_unique
    assert report["structure"]["sharing_groups"] == sharing_groups


def test_prompt_only_shares_just_the_prompt_within_each_uid(capsys, tmp_path):
    prompt, common = list(range(1, 11)), list(range(50, 59))  # 10 prompt tokens, then 9 alike
    path = write_jsonl(tmp_path / "r.jsonl", [
        {"uid": "a", "prompt_ids": prompt, "response_ids": common + [1]},
        {"uid": "a", "prompt_ids": prompt, "response_ids": common + [2]},
        {"uid": "b", "prompt_ids": prompt, "response_ids": [3]},  # same prompt, another uid
    ])
    assert analyze_json(capsys, path)["tokens_unique"] == 10 + 9 + 1 + 1 + 1
    report = analyze_json(capsys, path, "--mode", "prompt_only")
    assert report["tokens_unique"] == 20 + 10 + 11
    assert report["structure"] == {
        "sharing_groups": 1, "largest_sharing_group": 2, "longest_shared_prefix": 10,
        "deepest_reuse_chain": 1, "sequences_computing_nothing": 0,
    }


def test_parquet_gives_the_report_of_the_same_jsonl(capsys, tmp_path, grpo_file):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "grpo.parquet"
    pq.write_table(pa.Table.from_pylist(GRPO_ROWS), path)
    from_parquet = analyze_json(capsys, path, "--mode", "prompt_only")
    from_jsonl = analyze_json(capsys, grpo_file, "--mode", "prompt_only")
    for report in (from_parquet, from_jsonl):
        del report["file"], report["planner_ms"]
    assert from_parquet == from_jsonl


# --------------------------------------------------------------------------- text report
def test_text_report_gives_the_figures_and_the_prefix_tree(capsys, grpo_file):
    code, out, err = analyze(capsys, grpo_file)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{grpo_file}: 6 sequences; mode arbitrary_prefix, min_prefix_len 8, min_group_size 2"
    assert re.search(r"^tokens unique +43 ", out, re.M)
    assert re.search(r"^token ratio +2\.02 ", out, re.M)
    assert re.search(r"^sharing groups +2  largest: 3 sequences$", out, re.M)
    assert lines[-9:] == [
        "prefix tree (every edge computed once; seq i: where sequence i ends):",
        "├─ 10 tokens, shared by 3",
        "│  ├─ 3 tokens: seq 0",
        "│  ├─ 4 tokens: seq 1",
        "│  └─ 5 tokens: seq 2",
        "└─ 12 tokens, shared by 3",
        "   ├─ 2 tokens: seq 3",
        "   ├─ 6 tokens: seq 4",
        "   └─ 1 token: seq 5",
    ]


def test_no_tree_is_drawn_above_the_limit(capsys, tmp_path):
    rows = [{"input_ids": list(range(20)) + [100 + i]} for i in range(TREE_LIMIT + 1)]
    code, out, _ = analyze(capsys, write_jsonl(tmp_path / "r.jsonl", rows))
    assert code == 0
    assert out.splitlines()[-1] == f"prefix tree: not drawn for more than {TREE_LIMIT} sequences"
    assert "─" not in out


# --------------------------------------------------------------------------- structure
def test_duplicates_and_strict_prefixes_compute_nothing_and_end_inside_the_tree():
    base = list(range(1, 13))
    plan = build_plan([base, base, base[:9], base + [50]], EVERY_PREFIX)
    assert prefix_tree(plan) == [
        "└─ 9 tokens, shared by 4: seq 2",
        "   └─ 3 tokens, shared by 3: seq 0, 1",
        "      └─ 1 token: seq 3",
    ]
    assert sharing_structure(plan) == {
        "sharing_groups": 1, "largest_sharing_group": 4, "longest_shared_prefix": 12,
        "deepest_reuse_chain": 1, "sequences_computing_nothing": 3,
    }


def test_a_branch_that_reads_a_branch_makes_a_reuse_chain_of_two():
    prompt, branch = list(range(1, 9)), [50, 51]
    # sorted: c computes the prompt, a reads it, b reads the prompt (from c) and the branch (from a)
    a, b, c = prompt + branch + [60], prompt + branch + [61], prompt + [40]
    plan = build_plan([a, b, c], EVERY_PREFIX)
    assert sharing_structure(plan)["deepest_reuse_chain"] == 2
    assert prefix_tree(plan) == [
        "└─ 8 tokens, shared by 3",
        "   ├─ 2 tokens, shared by 2",
        "   │  ├─ 1 token: seq 0",
        "   │  └─ 1 token: seq 1",
        "   └─ 1 token: seq 2",
    ]


def test_unshared_sequences_have_no_structure_and_a_tree_of_separate_roots():
    plan = build_plan([[1, 2, 3], [4, 5]], EVERY_PREFIX)
    assert sharing_structure(plan) == dict.fromkeys(STRUCTURE_KEYS, 0)
    assert prefix_tree(plan) == ["├─ 3 tokens: seq 0", "└─ 2 tokens: seq 1"]


TREE_LINE = re.compile(r"^((?:│  |   )*)[├└]─ (\d+) tokens?(?:, shared by \d+)?(?:: seq ([\d, ]+))?$")


@given(forests(), st.integers(1, 3), st.integers(2, 3), st.sampled_from(["arbitrary_prefix", "off"]))
def test_tree_edges_add_up_to_the_computed_tokens_and_every_path_to_its_sequence(
    seqs, min_prefix_len, min_group_size, mode
):
    plan = build_plan(seqs, PrefixSharingConfig(mode, min_prefix_len, min_group_size))
    depth_tokens, edges, path_len = [], 0, {}
    for line in prefix_tree(plan):
        indent, tokens, ends = TREE_LINE.match(line).groups()
        depth = len(indent) // 3
        depth_tokens[depth:] = [(depth_tokens[depth - 1] if depth else 0) + int(tokens)]
        edges += int(tokens)
        for s in (ends or "").replace(",", " ").split():
            assert int(s) not in path_len
            path_len[int(s)] = depth_tokens[depth]
    assert edges == plan.num_tokens_unique
    assert path_len == {i: len(s) for i, s in enumerate(seqs)}


# --------------------------------------------------------------------------- bad input
def jsonl(*rows):
    return "".join(json.dumps(row) + "\n" for row in rows)


BAD_INPUT = [
    # (file name, file text or None for no file, extra options, message fragment)
    ("nope.jsonl", None, [], "nope.jsonl: no such file"),
    ("r.txt", jsonl({"input_ids": [1]}), [], "unsupported file type '.txt'"),
    ("r.jsonl", jsonl({"ids": [1]}), [], "needs an input_ids column, or prompt_ids and response_ids"),
    ("r.jsonl", jsonl({"response_ids": [1]}), [], "has a response_ids column but no prompt_ids"),
    ("r.jsonl", jsonl({"input_ids": [1]}, {"input_ids": [1]}, {"input_ids": [[1, 2], [3]]}), [],
     "line 3: input_ids[0] is [1, 2]; not an integer token id"),
    ("r.jsonl", jsonl({"input_ids": [1, "2"]}), [], 'line 1: input_ids[1] is "2"; not an integer'),
    ("r.jsonl", jsonl({"input_ids": [1, -2]}), [], "line 1: input_ids[1] is -2; token ids must be >= 0"),
    ("r.jsonl", jsonl({"input_ids": [2**31]}), [], "token ids must lie in [0, 2147483647]"),
    ("r.jsonl", "", [], "no rollouts (the file is empty)"),
    ("r.jsonl", jsonl({"input_ids": []}), [], "line 1: the sequence is empty"),
    ("r.jsonl", jsonl({"input_ids": [1]}), ["--model", "gpt-9"],
     f"unknown model preset 'gpt-9'; choose from {', '.join(PRESETS)}"),
    ("r.jsonl", jsonl({"input_ids": [1]}), ["--mode", "prompt"], "PrefixSharingConfig.mode must be one of"),
    ("r.jsonl", jsonl({"input_ids": [1]}), ["--min-prefix-len", "0"], "min_prefix_len must be an integer >= 1"),
    ("r.jsonl", jsonl({"input_ids": [1]}), ["--mode", "prompt_only"],
     "--mode prompt_only shares prompts, but {path} has input_ids only"),
    ("r.jsonl", jsonl(*GRPO_ROWS), ["--dp", "4"],
     "--dp 4: 6 rollouts do not divide over 4 ranks (verl pads the batch"),
    ("r.jsonl", jsonl({"input_ids": [1]}), ["--dp", "0"], "--dp must be >= 1; got 0"),
]


@pytest.mark.parametrize("name, text, options, message", BAD_INPUT)
def test_bad_input_is_one_error_line_and_a_nonzero_exit(capsys, tmp_path, name, text, options, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    code, out, err = analyze(capsys, path, *options)
    assert code != 0
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("prefix-sharing analyze: error: ")
    assert message.format(path=path) in err


def test_bad_parquet_is_one_error_line(capsys, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"input_ids": [[1.5, 2.0]]}), path)
    code, _, err = analyze(capsys, path)
    assert code != 0
    assert err == (f"prefix-sharing analyze: error: {path}: column input_ids must hold lists of "
                   "integer token ids; its type is list<element: double>\n")


def test_parquet_without_pyarrow_is_one_line_naming_pip_install(capsys, tmp_path, monkeypatch):
    path = tmp_path / "r.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    code, _, err = analyze(capsys, path)
    assert code != 0
    assert err.startswith("prefix-sharing analyze: error: reading Parquet rollouts needs pyarrow: "
                          "pip install pyarrow")
    assert err.count("\n") == 1


def test_console_command_reports_bad_input_without_a_traceback(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": [1, 2]}, {"input_ids": [3, 4.5]}])
    done = subprocess.run([sys.executable, "-m", "prefix_sharing", "analyze", path],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (f"prefix-sharing analyze: error: {path} line 2: input_ids[1] is 4.5; "
                           "not an integer token id\n")


# --------------------------------------------------------------------------- recorded routes
def test_routes_in_the_file_report_how_often_they_diverge(capsys, tmp_path):
    """Four sequences share 10 tokens; the last one's routes differ from its 6th token on."""
    prompt = list(range(1, 11))
    rows = [{"input_ids": prompt + [20 + k], "routed_experts": [[[t % 4, 4]] for t in prompt + [0]]}
            for k in range(4)]
    rows[3]["routed_experts"][5][0][1] = 5
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    report = analyze_json(capsys, path, "--min-prefix-len", "2")
    assert report["route_divergent_prefix_tokens"] == 5  # tokens 5..9 of the last, again
    assert report["route_divergent_share"] == 5 / 30
    assert report["tokens_unique"] == 11 + 1 + 1 + 6
    code, out, _ = analyze(capsys, path, "--min-prefix-len", "2")
    assert code == 0 and "route divergence" in out and "16.7% of what tokens alone" in out
    without = write_jsonl(tmp_path / "plain.jsonl", [{"input_ids": r["input_ids"]} for r in rows])
    report = analyze_json(capsys, without, "--min-prefix-len", "2")
    assert "route_divergent_prefix_tokens" not in report and report["tokens_unique"] == 14


# --------------------------------------------------------------------------- --dp N
DP_KEYS = {"dp_size", "verl_stock", "sharing_aware", "ideal"}
ROW_KEYS = {"tokens_computed", "token_ratio", "cost_imbalance", "groups_split"}


def verl_installed():
    try:
        import verl.utils.seqlen_balancing  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("mode", ["arbitrary_prefix", "prompt_only"])
def test_dp_puts_each_uid_group_on_one_rank_and_reports_the_ideal(capsys, grpo_file, mode):
    report = analyze_json(capsys, grpo_file, "--dp", "2", "--mode", mode)
    dp = report["data_parallel"]
    assert DP_KEYS <= set(dp) and dp["dp_size"] == 2
    aware = dp["sharing_aware"]
    assert set(aware) == ROW_KEYS
    # one prompt group a rank: 10 + 3 + 4 + 5 and 12 + 2 + 6 + 1 tokens
    assert sorted(aware["tokens_computed"]) == [21, 22] and aware["groups_split"] == 0
    assert aware["token_ratio"] == pytest.approx(GRPO_TOTAL / GRPO_UNIQUE)
    assert dp["ideal"] == {"tokens_computed": GRPO_UNIQUE,
                           "token_ratio": pytest.approx(GRPO_TOTAL / GRPO_UNIQUE)}
    assert aware["cost_imbalance"] >= 1.0


def test_dp_without_uids_keeps_each_prefix_tree_on_one_rank(capsys, tmp_path):
    rows = [{"input_ids": seq} for seq in GRPO_SEQUENCES]  # no prompt_ids: trees found
    report = analyze_json(capsys, write_jsonl(tmp_path / "r.jsonl", rows), "--dp", "2")
    assert sorted(report["data_parallel"]["sharing_aware"]["tokens_computed"]) == [21, 22]


def test_dp_text_report_gives_a_row_per_balancing(capsys, grpo_file):
    code, out, err = analyze(capsys, grpo_file, "--dp", "2")
    assert (code, err) == (0, "")
    assert "data-parallel ranks: 2 (tokens computed per rank)" in out
    assert re.search(r"^  sharing-aware +token ratio 2\.02, cost max/mean 1\.\d{3}, "
                     r"groups split 0\n    2[12] 2[12]$", out, re.M)
    assert re.search(r"^  ideal +token ratio 2\.02 \(43 tokens: each group whole on one rank\)$",
                     out, re.M)


@pytest.mark.skipif(verl_installed(), reason="verl is installed: the stock row is computed")
def test_dp_without_verl_says_the_stock_row_needs_it(capsys, grpo_file):
    dp = analyze_json(capsys, grpo_file, "--dp", "2")["data_parallel"]
    assert dp["verl_stock"] is None
    assert dp["verl_stock_unavailable"].startswith("needs verl installed (pip install verl)")
    _, out, _ = analyze(capsys, grpo_file, "--dp", "2")
    assert re.search(r"^  verl stock balancing  needs verl installed", out, re.M)


def test_dp_stock_row_is_verls_partition_planned_per_rank(capsys, grpo_file):
    balancing = pytest.importorskip("verl.utils.seqlen_balancing",
                                    reason="the stock row is verl's own partition function")
    import torch

    dp = analyze_json(capsys, grpo_file, "--dp", "2")["data_parallel"]
    lengths = torch.tensor([len(s) for s in GRPO_SEQUENCES])
    ranks = balancing.get_seqlen_balanced_partitions(
        balancing.calculate_workload(lengths), k_partitions=2, equal_size=True)
    expected = [build_plan([GRPO_SEQUENCES[i] for i in p]).num_tokens_unique for p in ranks]
    stock = dp["verl_stock"]
    assert stock["tokens_computed"] == expected
    assert "verl_stock_unavailable" not in dp
    assert stock["token_ratio"] == pytest.approx(GRPO_TOTAL / sum(expected))
    assert stock["token_ratio"] <= dp["sharing_aware"]["token_ratio"]
