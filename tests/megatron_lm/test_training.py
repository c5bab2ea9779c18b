"""Megatron-LM's own training loop (``pretrain()`` from megatron-core's bundled
``megatron.training``) with prefix sharing trains exactly like the same run with sharing off.

Each case runs ``python -m prefix_sharing.megatron_lm`` twice under torchrun on CPU (gloo) - with
``--prefix-sharing-mode arbitrary_prefix`` and ``off``, same seed, same data, same micro-batches -
and compares every iteration's ``lm loss`` (1e-5 relative) and every parameter after the last
step. The parameter bound is the one tests/megatron_ext/test_training.py derives for Adam
(per tensor ``||shared - off|| / ||off|| <= 1e-4``: Adam turns 1e-7 reorderings of fp32 gradient
sums into updates of either sign for near-zero elements). Data: Megatron-LM's SFT dataset over
generated conversations that share system prompts and histories (TP=1, TP=2 with sequence
parallelism, PP=2), a tree-shaped trajectory file (TP=1, PP=2), and a file where nothing is
shared.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "megatron.training.argument_utils",
    reason="megatron.training is not installed: megatron-core >= 0.17 ships it; with 0.16.1 "
    "Megatron-LM's training loop needs a Megatron-LM core_r0.16.0 checkout",
)

from tests.megatron_lm._data import (  # noqa: E402
    write_conversations,
    write_tokenizer,
    write_trajectories,
)

ITERS = 3
MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "128",
    "--max-position-embeddings", "512", "--transformer-impl", "local", "--normalization",
    "RMSNorm", "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--no-gradient-accumulation-fusion", "--use-cpu-initialization", "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
]
TRAINING = [
    "--train-iters", str(ITERS), "--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style",
    "constant", "--distributed-backend", "gloo", "--log-interval", "1", "--eval-iters", "0",
    "--eval-interval", "1000", "--seed", "1234",
]
LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}


def _train(tmp: Path, name: str, kind: str, data_args: list[str], layout: str,
           mode: str) -> list[dict]:
    """Runs the entry point; returns each rank's ``{"reports": [...], "params": {...}}``."""
    nproc, parallel = LAYOUTS[layout]
    out = tmp / f"{name}-{layout}-{mode}"
    out.mkdir()
    env = {**os.environ, "PREFIX_SHARING_TEST_OUT": str(out), "OMP_NUM_THREADS": "1",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]),
                                          os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), "-m", "tests.megatron_lm._driver", kind,
               *MODEL, *TRAINING, *parallel, *data_args, "--prefix-sharing-mode", mode]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(nproc)]


def _free_port() -> int:
    from prefix_sharing.engines.launch import free_port

    return free_port()


def _assert_same_training(shared: list[dict], off: list[dict]) -> list[dict]:
    """Same loss every iteration, same parameters at the end; returns the last stage's reports."""
    last = [r["reports"] for r in shared if r["reports"]][0]
    last_off = [r["reports"] for r in off if r["reports"]][0]
    assert len(last) == len(last_off) == ITERS
    for step, (a, b) in enumerate(zip(last, last_off)):
        assert abs(a["lm loss"] - b["lm loss"]) <= 1e-5 * abs(b["lm loss"]), (step, a, b)
        assert a["tokens total"] == b["tokens total"] == b["tokens computed"], (step, a, b)
    for rank, (mine, plain) in enumerate(zip(shared, off)):
        assert mine["params"].keys() == plain["params"].keys() and plain["params"]
        for name, p in plain["params"].items():
            drift = ((mine["params"][name] - p).norm() / p.norm()).item()
            assert drift <= 1e-4, (rank, name, drift)
    return last


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> list[str]:
    pytest.importorskip("transformers", reason="Megatron-LM's SFTTokenizer wraps a HF tokenizer")
    tmp = tmp_path_factory.mktemp("sft")
    tokenizer = str(write_tokenizer(tmp / "tok"))
    return ["--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tokenizer,
            "--sft-tokenizer-prompt-format", "nemotron-h-aligned", "--seq-length", "256",
            "--micro-batch-size", "2", "--global-batch-size", "4",
            "--data-path", str(write_conversations(tmp / "convs.jsonl", shared=True))]


def _trajectory_args(path: Path) -> list[str]:
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", "511", "--seq-length", "256",
            "--micro-batch-size", "1", "--global-batch-size", "2",
            "--prefix-sharing-data", str(path), "--prefix-sharing-token-budget", "200"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sft_conversations_train_like_sharing_off(tmp_path, sft_data, layout):
    shared = _train(tmp_path, "sft", "sft", sft_data, layout, "arbitrary_prefix")
    off = _train(tmp_path, "sft", "sft", sft_data, layout, "off")
    reports = _assert_same_training(shared, off)
    for report in reports:  # the system prompts and histories were computed once
        assert report["tokens computed"] < 0.8 * report["tokens total"], report


@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_tree_trajectories_train_like_sharing_off(tmp_path, layout):
    data = _trajectory_args(write_trajectories(tmp_path / "tree.jsonl", tree=True))
    shared = _train(tmp_path, "tree", "gpt", data, layout, "arbitrary_prefix")
    off = _train(tmp_path, "tree", "gpt", data, layout, "off")
    reports = _assert_same_training(shared, off)
    for report in reports:  # one tree of 4 leaves per micro-batch: ~2.3x fewer tokens
        assert report["token ratio"] > 2.0, report


@pytest.mark.parametrize("layout", ["tp1", "pp2"])
def test_mtp_layers_train_like_sharing_off(tmp_path, sft_data, layout):
    """``--mtp-num-layers 1``: Megatron-LM builds the MTP block around the sharing layer spec
    (the forward step makes its layers the sharing ones) and trains it with its loss; under
    PP=2 the MTP layer sits on the last stage. The MTP parameters move and end equal."""
    mtp = ["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"]
    shared = _train(tmp_path, "mtp", "sft", sft_data + mtp, layout, "arbitrary_prefix")
    off = _train(tmp_path, "mtp", "sft", sft_data + mtp, layout, "off")
    for report in _assert_same_training(shared, off):
        assert report["tokens computed"] < 0.8 * report["tokens total"], report
    assert any(name.startswith("mtp.") for rank in shared for name in rank["params"])
    if layout == "tp1":  # the MTP loss trained the decoder: without MTP it ends elsewhere
        plain = _train(tmp_path, "no-mtp", "sft", sft_data, layout, "off")[0]["params"]
        name = "decoder.layers.0.mlp.linear_fc1.weight"
        moved = (shared[0]["params"][name] - plain[name]).norm() / plain[name].norm()
        assert moved > 1e-4, float(moved)


def test_nothing_shared_trains_like_sharing_off(tmp_path):
    data = _trajectory_args(write_trajectories(tmp_path / "flat.jsonl", tree=False))
    shared = _train(tmp_path, "flat", "gpt", data, "tp1", "arbitrary_prefix")
    off = _train(tmp_path, "flat", "gpt", data, "tp1", "off")
    for report in _assert_same_training(shared, off):
        assert report["tokens computed"] == report["tokens total"], report
