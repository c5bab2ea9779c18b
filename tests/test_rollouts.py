"""load_rollouts: the rollout files analyze (and later verify / bench) read, and how they fail."""

import json
import re
import sys

import numpy as np
import pytest
import torch

from prefix_sharing import PromptGroup
from prefix_sharing.rollouts import RolloutError, load_rollouts


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path, columns):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path, row_group_size=2)  # several chunks per column
    return path


def as_lists(rollouts):
    return [s.tolist() for s in rollouts.sequences]


# --------------------------------------------------------------------------- what is read
def test_jsonl_input_ids_become_int64_sequences_in_file_order(tmp_path):
    rollouts = load_rollouts(write_jsonl(tmp_path / "r.jsonl", [
        {"input_ids": [5, 6, 7]}, {"input_ids": [8]}, {"input_ids": [9, 9], "reward": 1.0},
    ]))
    assert as_lists(rollouts) == [[5, 6, 7], [8], [9, 9]]
    assert all(s.dtype == torch.int64 for s in rollouts.sequences)
    assert rollouts.groups is None  # input_ids alone do not say where prompts end


def test_json_suffix_is_json_lines_and_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "r.JSON"
    path.write_text('{"input_ids": [1, 2]}\n\n  \n{"input_ids": [3]}')  # no final newline
    assert as_lists(load_rollouts(path)) == [[1, 2], [3]]


def test_prompt_and_response_are_concatenated_and_grouped_by_uid(tmp_path):
    rollouts = load_rollouts(write_jsonl(tmp_path / "r.jsonl", [
        {"uid": "a", "prompt_ids": [1, 2, 3], "response_ids": [4]},
        {"uid": 7, "prompt_ids": [1, 2, 3], "response_ids": [5, 6]},  # same prompt, other uid
        {"uid": "a", "prompt_ids": [1, 2, 3], "response_ids": []},  # an empty response is fine
    ]))
    assert as_lists(rollouts) == [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3]]
    assert rollouts.groups == [PromptGroup(3, [0, 2]), PromptGroup(3, [1])]


def test_without_uid_rows_with_identical_prompts_form_a_group(tmp_path):
    rollouts = load_rollouts(write_jsonl(tmp_path / "r.jsonl", [
        {"prompt_ids": [1, 2], "response_ids": [3]},
        {"prompt_ids": [1, 2, 3], "response_ids": [4]},
        {"prompt_ids": [1, 2], "response_ids": [5]},
    ]))
    assert rollouts.groups == [PromptGroup(2, [0, 2]), PromptGroup(3, [1])]


def test_prompt_and_response_take_precedence_over_input_ids(tmp_path):
    rollouts = load_rollouts(write_jsonl(tmp_path / "r.jsonl", [
        {"input_ids": [0, 0, 1, 2, 3], "prompt_ids": [1, 2], "response_ids": [3]},  # padded
    ]))
    assert as_lists(rollouts) == [[1, 2, 3]]
    assert rollouts.groups == [PromptGroup(2, [0])]


def test_parquet_list_columns_read_like_jsonl_numpy_arrays_included(tmp_path):
    prompts = [np.array([1, 2, 3], dtype=np.int32)] * 3 + [np.array([7, 8], dtype=np.int32)]
    responses = [np.array([4]), np.array([5, 6]), np.array([], dtype=np.int64), np.array([9])]
    rollouts = load_rollouts(write_parquet(tmp_path / "r.parquet", {
        "prompt_ids": prompts, "response_ids": responses, "uid": ["a", "a", "a", "b"],
    }))
    assert as_lists(rollouts) == [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2, 3], [7, 8, 9]]
    assert all(s.dtype == torch.int64 for s in rollouts.sequences)
    assert rollouts.groups == [PromptGroup(3, [0, 1, 2]), PromptGroup(2, [3])]


def test_parquet_input_ids_give_no_groups(tmp_path):
    rollouts = load_rollouts(write_parquet(tmp_path / "r.parquet", {
        "input_ids": [[1, 2], [3], [4, 5, 6]], "uid": ["x", "x", "y"],
    }))
    assert as_lists(rollouts) == [[1, 2], [3], [4, 5, 6]]
    assert rollouts.groups is None


@pytest.mark.parametrize("list_type", ["large_list", "fixed_size_list"])
def test_parquet_large_and_fixed_size_lists_are_read_too(tmp_path, list_type):
    pa = pytest.importorskip("pyarrow")
    kind = pa.large_list(pa.uint16()) if list_type == "large_list" else pa.list_(pa.int8(), 2)
    ids = pa.array([[1, 2], [3, 4], [5, 6]], kind)
    rollouts = load_rollouts(write_parquet(tmp_path / "r.parquet", {"input_ids": ids}))
    assert as_lists(rollouts) == [[1, 2], [3, 4], [5, 6]]


# --------------------------------------------------------------------------- what is refused
def jsonl(*lines):
    return "".join(line + "\n" for line in lines)


BAD_JSONL = [
    # (file name, text, message after the path)
    ("r.csv", "input_ids\n1 2 3\n", ": unsupported file type '.csv'; expected .jsonl"),
    ("r", jsonl('{"input_ids": [1]}'), ": unsupported file type '(no suffix)'"),
    ("r.jsonl", "", ": no rollouts (the file is empty)"),
    ("r.jsonl", "\n  \n", ": no rollouts (the file is empty)"),
    ("r.jsonl", jsonl('{"input_ids": [1]}', '{"input_ids": [1'), " line 2: not valid JSON"),
    ("r.jsonl", jsonl("[1, 2, 3]"), " line 1: expected a JSON object (one rollout per line); got list"),
    ("r.jsonl", jsonl('{"tokens": [1], "uid": 3}'),
     ": needs an input_ids column, or prompt_ids and response_ids; found: tokens, uid"),
    ("r.jsonl", jsonl('{"prompt_ids": [1]}'), ": has a prompt_ids column but no response_ids"),
    ("r.jsonl", jsonl('{"input_ids": [1]}', "", '{"prompt_ids": [1]}'),
     " line 3: missing input_ids (line 1 has it)"),
    ("r.jsonl", jsonl('{"input_ids": "1 2 3"}'), ' line 1: input_ids must be a list of integers; got "1 2 3"'),
    ("r.jsonl", jsonl('{"input_ids": [1]}', '{"input_ids": [1]}', '{"input_ids": [[1, 2], [3]]}'),
     " line 3: input_ids[0] is [1, 2]; not an integer token id"),
    ("r.jsonl", jsonl('{"input_ids": [1, 2.5]}'), " line 1: input_ids[1] is 2.5; not an integer"),
    ("r.jsonl", jsonl('{"input_ids": [1, true]}'), " line 1: input_ids[1] is true; not an integer"),
    ("r.jsonl", jsonl('{"input_ids": [1, -2]}'), " line 1: input_ids[1] is -2; token ids must be >= 0"),
    ("r.jsonl", jsonl('{"input_ids": [1, 1180591620717411303424]}'),
     " line 1: input_ids has a token id beyond int64"),
    ("r.jsonl", jsonl('{"input_ids": [1]}', '{"input_ids": []}'),
     " line 2: the sequence is empty (no token ids)"),
    ("r.jsonl", jsonl('{"prompt_ids": [], "response_ids": []}'), " line 1: the sequence is empty"),
    ("r.jsonl", jsonl('{"prompt_ids": [1], "response_ids": [-1]}'),
     " line 1: response_ids[0] is -1; token ids must be >= 0"),
    ("r.jsonl", jsonl('{"uid": [1], "prompt_ids": [1], "response_ids": [2]}'),
     " line 1: uid must be a string or an integer; got [1]"),
    ("r.jsonl", jsonl('{"uid": "a", "prompt_ids": [1, 2], "response_ids": [3]}',
                      '{"uid": "a", "prompt_ids": [1, 9], "response_ids": [3]}'),
     " line 2: uid 'a' has a different prompt than {path} line 1"),
]


@pytest.mark.parametrize("name, text, message", BAD_JSONL)
def test_bad_json_lines_name_the_file_the_line_and_the_problem(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    expected = re.escape(str(path) + message.format(path=path))
    with pytest.raises(RolloutError, match=f"^{expected}"):
        load_rollouts(path)


def test_non_utf8_text_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(RolloutError, match="not UTF-8 text"):
        load_rollouts(path)


def test_a_missing_file_is_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl: no such file"):
        load_rollouts(tmp_path / "nope.jsonl")


BAD_PARQUET = [
    ({"input_ids": [[1.0, 2.0]]},
     ": column input_ids must hold lists of integer token ids; its type is list<element: double>"),
    ({"input_ids": [[[1, 2], [3]]]}, ": column input_ids must hold lists of integer token ids"),
    ({"input_ids": ["1 2"]}, ": column input_ids must hold lists of integer token ids; its type is string"),
    ({"input_ids": [[1], [2], [3, -3]]}, " row 2: input_ids holds -3; token ids must be >= 0"),
    ({"input_ids": [[1], None]}, " row 1: input_ids is null"),
    ({"input_ids": [[1], [2], [4, None]]}, " row 2: input_ids holds a null token id"),
    ({"input_ids": [[1], []]}, " row 1: the sequence is empty"),
    ({"ids": [[1]]}, ": needs an input_ids column, or prompt_ids and response_ids; found: ids"),
    ({"prompt_ids": [[1]], "response_ids": [[2]], "uid": [None]},
     " row 0: uid must be a string or an integer; got null"),
]


@pytest.mark.parametrize("columns, message", BAD_PARQUET)
def test_bad_parquet_names_the_file_the_row_and_the_problem(tmp_path, columns, message):
    path = write_parquet(tmp_path / "r.parquet", columns)
    with pytest.raises(RolloutError, match="^" + re.escape(str(path) + message)):
        load_rollouts(path)


def test_a_parquet_table_without_rows_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    path = write_parquet(tmp_path / "r.parquet", {"input_ids": pa.array([], pa.list_(pa.int64()))})
    with pytest.raises(RolloutError, match="r.parquet: no rollouts \\(the table has no rows\\)"):
        load_rollouts(path)


def test_a_file_that_is_not_parquet_is_refused(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "r.parquet"
    path.write_text('{"input_ids": [1]}\n')
    with pytest.raises(RolloutError, match="r.parquet: not a readable Parquet file"):
        load_rollouts(path)


def test_parquet_without_pyarrow_names_the_install_command(tmp_path, monkeypatch):
    path = tmp_path / "r.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    with pytest.raises(ImportError, match="needs pyarrow: pip install pyarrow"):
        load_rollouts(path)


# ----------------------------------------------------------------------------- recorded routes
ROUTED = [{"input_ids": [1, 2, 3], "routed_experts": [[[0, 1]], [[2, 3]], [[4, 5]]]},
          {"input_ids": [1, 2], "routed_experts": [[[0, 1]], [[2, 7]]]}]


def test_routed_experts_are_read_per_token_from_jsonl_and_parquet(tmp_path):
    from_jsonl = load_rollouts(write_jsonl(tmp_path / "r.jsonl", ROUTED))
    columns = {k: [row[k] for row in ROUTED] for k in ROUTED[0]}
    from_parquet = load_rollouts(write_parquet(tmp_path / "r.parquet", columns))
    for rollouts in (from_jsonl, from_parquet):
        assert [r.shape for r in rollouts.routes] == [(3, 1, 2), (2, 1, 2)]
        assert rollouts.routes[1].dtype == torch.int64
        assert rollouts.routes[1].tolist() == [[[0, 1]], [[2, 7]]]
    assert load_rollouts(write_jsonl(tmp_path / "n.jsonl", [{"input_ids": [1]}])).routes is None


@pytest.mark.parametrize("routes, message", [
    ([[[0, 1]], [[2, 3]]], r"line 1: routed_experts has shape \(2, 1, 2\); expected \(3, L, k\)"),
    ([[0, 1], [2, 3], [4, 5]], r"line 1: routed_experts must be a \[tokens\]\[moe_layers\]\[topk\]"),
    ([[[0, -1]], [[2, 3]], [[4, 5]]], "expert ids >= 0"),
])
def test_bad_routes_name_the_line(tmp_path, routes, message):
    path = write_jsonl(tmp_path / "r.jsonl", [dict(ROUTED[0], routed_experts=routes)])
    with pytest.raises(RolloutError, match=message):
        load_rollouts(path)


def test_routes_of_another_shape_than_the_first_row_are_refused(tmp_path):
    rows = [ROUTED[0], dict(ROUTED[1], routed_experts=[[[0, 1, 2]], [[2, 7, 3]]])]
    with pytest.raises(RolloutError, match=r"line 2: .* expected \(2, 1, 2\)"):
        load_rollouts(write_jsonl(tmp_path / "r.jsonl", rows))
