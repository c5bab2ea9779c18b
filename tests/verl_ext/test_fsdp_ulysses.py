"""verl's real FSDP engine with Ulysses sequence parallelism and ``prefix_grouper`` on gives
what verl's own Ulysses step gives on the same weights (whichever supported verl is installed).

Two gloo ranks form one Ulysses group (``ulysses_sequence_parallel_size=2``, one data-parallel
rank; both ranks get the same batch, as verl's worker dispatches it), four ranks a group of 4
on one GRPO batch (the tiny preset's 2 K/V heads are then repeated). Compared, fp32 within
1e-5: old log-probs and entropy, verl's ``ppo_loss`` and every gradient after FSDP2's
reduction, on GRPO and tree batches; and, in the 2-rank process, verl's SFT step (the SFT
engine section, ``sft_loss``, conversations sharing a system prompt plus a turn chain:
``_sft``): the log-probs of every position, the loss and every gradient.

verl's stock Ulysses step cannot run on CPU as shipped: its all-to-all lives in a replacement
of transformers' ``_flash_attention_forward`` that calls the flash-attention kernel. The
reference therefore loads the model with transformers' own flash-attention integration function
registered under another name (verl's patch reaches it unchanged) and swaps only the kernel:
:func:`cpu_varlen_kernel` stands in for ``_flash_attention_forward`` inside verl's wrapper, with
flash-attention's packed semantics (causal per segment, segments starting where
``position_ids`` is 0; verl's Ulysses pad restarts at 0 too). Test support, never the library.

The control: the log-probs' gather without verl's gradient scaling (each rank's loss counted
once instead of the group size times) keeps log-probs and loss exact and gets the gradients
wrong, as the comparison shows (GRPO and SFT: the sharing step ran through the Ulysses split).
"""

import contextlib
import functools
import importlib.util
from functools import partial

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES, same_outputs  # noqa: E402
from tests.verl_ext._fsdp_engine import save_model  # noqa: E402
from tests.verl_ext._sft import SYSTEM  # noqa: E402

REFERENCE_ATTENTION = "cpu_varlen_reference"  # transformers' flash integration, CPU kernel (a name
# with "flash" in it makes transformers look for the flash-attention package)
SHARING = MODES["arbitrary_prefix"]
KERNEL_CALLS = {"n": 0}  # in a rank: how often verl's Ulysses wrapper called the CPU kernel


def cpu_varlen_kernel(query, key, value, attention_mask, query_length, *args,
                      position_ids=None, softmax_scale=None, **kwargs):
    """transformers' ``_flash_attention_forward`` on CPU for verl's packed row:
    ``(1, T, heads, d)`` queries over ``(1, T, kv_heads, d)`` keys, causal within each segment
    (a segment starts where ``position_ids`` is 0)."""
    import torch
    import torch.nn.functional as F

    assert attention_mask is None and query.size(0) == 1 and position_ids is not None
    KERNEL_CALLS["n"] += 1
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten().tolist() + [query.size(1)]
    pieces = []
    for a, b in zip(starts[:-1], starts[1:]):
        q, k, v = (x[0, a:b].transpose(0, 1) for x in (query, key, value))
        pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=softmax_scale,
                                                     enable_gqa=True).transpose(0, 1))
    return torch.cat(pieces)[None]


def use_reference_attention() -> None:
    """Registers :data:`REFERENCE_ATTENTION` and puts :func:`cpu_varlen_kernel` where verl's
    Ulysses wrapper calls the flash kernel (module doc)."""
    from transformers import AttentionInterface
    from transformers.integrations import flash_attention
    from verl.models.transformers import monkey_patch

    AttentionInterface.register(REFERENCE_ATTENTION, flash_attention.flash_attention_forward)
    monkey_patch._flash_attention_forward = cpu_varlen_kernel


def rank_run(rank: int, path: str, size: int, workloads: list[str], control: bool) -> dict:
    """Per workload: verl's stock Ulysses step and the sharing one (and with ``control`` the
    sharing step on the first workload with the control's gather); one engine per mode from
    the same checkpoint, which no step changes (no optimizer step; ``train_mode`` zeroes the
    gradients on exit). ``_fsdp_engine.run``'s outputs and gradients."""
    from verl.workers.utils.losses import ppo_loss

    from prefix_sharing.fsdp_compat.fsdp import full_gradients
    from tests.verl_ext._batch import make_batch, plain_output, use_cpu_platform
    from tests.verl_ext._fsdp_engine import actor_config, build_engine

    use_cpu_platform()
    use_reference_attention()

    def step(engine, config, workload):
        KERNEL_CALLS["n"] = 0
        batch = partial(make_batch, workload, seed=0)  # the Ulysses group shares its batch
        with engine.eval_mode():
            infer = engine.infer_batch(batch())
        with engine.train_mode():
            train = engine.forward_backward_batch(batch(), partial(ppo_loss, config=config))
            grads = full_gradients(engine.module)
        return {"infer": plain_output(infer), "train": plain_output(train), "grads": grads,
                "engine": type(engine).__name__, "kernel_calls": KERNEL_CALLS["n"]}

    results = {}
    for mode, prefix_grouper in (("stock", None), ("sharing", SHARING)):
        config = actor_config(prefix_grouper, ulysses_sequence_parallel_size=size)
        override = {} if prefix_grouper else {"attn_implementation": REFERENCE_ATTENTION}
        engine = build_engine(config, path, **({"override_config": override} if override else {}))
        for workload in workloads:
            results[workload, mode] = step(engine, config, workload)
    if control:
        with gather_without_gradient_scale():
            results[workloads[0], "control"] = step(engine, config, workloads[0])
        results.update(sft_runs(path, size))
    return results


@contextlib.contextmanager
def gather_without_gradient_scale():
    """The control: within the block the sharing step's log-prob gather counts each rank's
    loss once instead of the group size times (verl's gradient scaling dropped)."""
    from prefix_sharing.fsdp_compat import ulysses

    backward = ulysses._SumOverGroup.backward
    ulysses._SumOverGroup.backward = staticmethod(lambda ctx, grad: (grad, None))
    try:
        yield
    finally:
        ulysses._SumOverGroup.backward = backward


def sft_runs(path: str, size: int) -> dict:
    """verl's SFT step (``_sft``: the SFT engine section, ``sft_loss``, conversations sharing
    a system prompt plus a turn chain) under Ulysses: stock, sharing, and sharing under the
    control's gather."""
    from tests.verl_ext._fsdp_engine import build_engine
    from tests.verl_ext._sft import fsdp_sft_config, fsdp_sft_step

    def step(engine):
        KERNEL_CALLS["n"] = 0
        return {**fsdp_sft_step(engine), "engine": type(engine).__name__,
                "kernel_calls": KERNEL_CALLS["n"]}

    results = {}
    for mode, prefix_grouper in (("stock", None), ("sharing", SHARING)):
        config = fsdp_sft_config(prefix_grouper, ulysses_sequence_parallel_size=size)
        override = {} if prefix_grouper else {"attn_implementation": REFERENCE_ATTENTION}
        engine = build_engine(config, path, **({"override_config": override} if override else {}))
        results["sft", mode] = step(engine)
    with gather_without_gradient_scale():
        results["sft", "control"] = step(engine)
    return results


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_model(str(tmp_path_factory.mktemp("qwen2")))


@functools.cache
def launched(path: str, size: int) -> list[dict]:
    workloads = ["grpo", "tree"] if size == 2 else ["grpo"]
    return run_gloo(rank_run, size, path, size, workloads, size == 2, timeout=500)


@pytest.mark.parametrize("size, workloads", [(2, ("grpo", "tree")), (4, ("grpo",))])
def test_sharing_under_ulysses_matches_verls_own_ulysses_step(checkpoint, size, workloads):
    for rank, runs in enumerate(launched(checkpoint, size)):
        for workload in workloads:
            stock, sharing = runs[workload, "stock"], runs[workload, "sharing"]
            assert sharing["engine"] == "PrefixSharingFSDPEngine"
            # the reference ran verl's Ulysses wrapper, the sharing step did not
            assert stock["kernel_calls"] > 0 and sharing["kernel_calls"] == 0
            same_outputs(sharing, stock, f"sp={size} rank {rank} {workload}")
            metrics = sharing["train"]["metrics"]
            assert (metrics["prefix_sharing/tokens_computed"][0]
                    < metrics["prefix_sharing/tokens_total"][0]), f"{workload}: nothing shared"


def test_control_the_gather_without_verls_gradient_scale_gets_the_gradients_wrong(checkpoint):
    runs = launched(checkpoint, 2)[0]
    control, stock = runs["grpo", "control"], runs["grpo", "stock"]
    with pytest.raises(AssertionError, match="grad"):
        same_outputs(control, stock, "control")
    same_outputs({**control, "grads": stock["grads"]}, stock, "control outputs")  # those exact


def test_the_sft_step_under_ulysses_matches_verls_own_ulysses_sft_step(checkpoint):
    for rank, runs in enumerate(launched(checkpoint, 2)):
        stock, sharing = runs["sft", "stock"], runs["sft", "sharing"]
        assert sharing["engine"] == "PrefixSharingFSDPEngine"
        assert stock["kernel_calls"] > 0 and sharing["kernel_calls"] == 0
        same_outputs(sharing, stock, f"sp=2 rank {rank} sft")
        assert all(loss != 0 for loss in stock["train"]["loss"])  # the loss mask selects tokens
        metrics = sharing["train"]["metrics"]
        # the system prompt once per micro-batch of 2 conversations, the chain's first turn once
        assert (metrics["prefix_sharing/tokens_total"][0]
                - metrics["prefix_sharing/tokens_computed"][0]) >= SYSTEM * 3
        control = runs["sft", "control"]  # the sharing step went through the Ulysses gather
        with pytest.raises(AssertionError, match="grad"):
            same_outputs(control, stock, "sft control")
        same_outputs({**control, "grads": stock["grads"]}, stock, "sft control outputs")


@pytest.mark.parametrize("family, preset, keys", [
    ("qwen2", "tiny", ()),
    ("qwen3_next", "tiny", ("verl.ulysses.recurrent",)),
    ("nemotron_h", "tiny-nemotron-h", ("verl.ulysses.recurrent",)),
    ("qwen2_5_vl", "tiny", ("verl.ulysses.vlm",)),
])
def test_models_whose_layers_ulysses_cannot_split_are_refused_by_name(family, preset, keys):
    """What the engine's construction (and preflight) raises, read from the HF config alone:
    the recurrent layers it names are the ones the sharing engine switches once verl has built
    the model."""
    import dataclasses

    from prefix_sharing.fsdp_compat import build_model, enable_prefix_sharing
    from prefix_sharing.fsdp_compat.vlm import vlm_release_problem
    from prefix_sharing.presets import PRESETS
    from prefix_sharing.verl_ext.ulysses import has_recurrent_layers, ulysses_problems

    if family == "nemotron_h":
        pytest.importorskip("transformers.models.nemotron_h", reason="Nemotron-H: transformers 5")
    if family == "qwen2_5_vl" and vlm_release_problem(family):
        pytest.skip("the VLM shim needs transformers 5.10 (verl 0.9.1's)")
    preset = PRESETS[preset]
    if family in ("qwen3_next", "qwen2_5_vl"):  # 4 layers, every other one full attention
        preset = dataclasses.replace(preset, num_layers=4, full_attention_every=2)
    model = enable_prefix_sharing(build_model(family, preset))
    assert tuple(found.key for found in ulysses_problems(model.config, 2)) == keys
    assert ulysses_problems(model.config, 1) == []
    assert has_recurrent_layers(model) == ("verl.ulysses.recurrent" in keys)
