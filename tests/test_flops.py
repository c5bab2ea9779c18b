"""``count_flops`` against the FLOPs torch counts on the Megatron engine's real steps.

``torch.utils.flop_counter.FlopCounterMode`` counts every matrix product of a forward+backward
of megatron's stock THD step (plain) and of the shared step, on the tiny preset and on
tiny-mla and small-mla (multi-latent attention, dense and MoE layers with a shared expert;
megatron-core 0.19's stock THD step also multiplies the zeros it pads MLA's V with, counted
apart). The model counts exactly those products: the linear layers and LM head (``aten.mm``,
forward and the two backward products) and attention - the stock step's ``aten.bmm``, and on
the shared step aten's fused CPU kernel, which attention over key sources calls directly and
which the counter is given torch's own dense SDPA formulas for (it has none). Systematic
differences, which the test accounts for: a dense kernel also computes the causal mask's
hidden half of every segment - ``s(s-1)/2`` (query, key) pairs of a segment with ``s``
queries - which ``count_flops`` leaves out, as flash-attn skips those blocks; the fused
kernel's backward recomputes the scores, and under MLA multiplies V zero-padded to the query
head dim. The embedding lookup, norms, rotary, softmax, the merge and the K/V gather are not
matrix products: neither side counts them.
"""

from __future__ import annotations

import dataclasses

import pytest

from prefix_sharing import PrefixSharingConfig, build_plan
from prefix_sharing.flops import count_flops
from prefix_sharing.presets import get_preset
from prefix_sharing.workloads import make_workload

from .megatron_ext._distributed import PRESET, run_distributed

CONFIG = PrefixSharingConfig(min_prefix_len=1)
WORKLOADS = {"tree": dict(depth=2, branching=3), "grpo": dict(num_prompts=2, group_size=4)}


# DeepSeek-V3's shape: MLA's projections, a dense first layer, routed and shared experts (top-2
# of 8 on tiny-mla; top-4 of 16, the shape of bench's MLA rows, on small-mla)
MLA = get_preset("tiny-mla")
SMALL_MLA = get_preset("small-mla")
MLA_WORKLOAD = "tree"


def _cpu_flash_formulas() -> dict:
    """FLOP formulas for aten's fused CPU attention kernel, which the shared step calls
    directly (attention over key sources: its forward returns the log-sum-exp, its backward
    takes it) and SDPA picks on CPU, but which ``FlopCounterMode`` has none for: torch's own
    dense SDPA formulas (its CUDA flash and efficient kernels' entries), so the kernel is
    counted as it runs - every (query, key) pair of a block, masked or not."""
    import torch
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def _counted_job(rank: int, batches: dict) -> dict:
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.core.transformer import multi_latent_attention

    from prefix_sharing.engines.megatron import forward_backward, gpt_model

    # megatron-core 0.19+ zero-pads MLA's V to the key's head dim on its own THD path
    counted = {"stock_thd_pads_v": hasattr(multi_latent_attention,
                                           "_prepare_mla_core_attention_value")}
    # megatron's MoE loss tracker keeps the layer count of the first MoE model that logs to
    # it in a process: the deeper model first
    for preset, names in ((PRESET, list(batches)), (SMALL_MLA, [MLA_WORKLOAD]),
                          (MLA, [MLA_WORKLOAD])):
        model = gpt_model(preset, layout="shared")
        for name in names:
            for layout in ("packed", "shared"):
                with FlopCounterMode(display=False,
                                     custom_mapping=_cpu_flash_formulas()) as counter:
                    forward_backward(model, [batches[name]], layout, CONFIG)
                totals = counter.get_flop_counts()["Global"]
                counted[preset.name, name, layout] = {str(op): n for op, n in totals.items()}
    return counted


@pytest.fixture(scope="module")
def counted():
    batches = {name: make_workload(name, vocab_size=PRESET.vocab_size, **sizes).sequences
               for name, sizes in WORKLOADS.items()}
    return batches, run_distributed(_counted_job, 1, batches, timeout=600)[0]


def _masked_pair_flops(query_lens: list[int], preset=PRESET) -> int:
    """Forward+backward FLOPs a dense kernel spends on the causally masked pairs."""
    head_dims = ((preset.head_dim, preset.head_dim) if preset.mla is None
                 else (preset.mla.q_head_dim, preset.mla.v_head_dim))
    per_pair = 2 * preset.num_attention_heads * sum(head_dims) * preset.num_layers
    return 3 * per_pair * sum(s * (s - 1) // 2 for s in query_lens)


def _fused_kernel_extra_flops(plan, preset=PRESET) -> int:
    """Forward+backward FLOPs the fused CPU kernel spends beyond the products ``count_flops``
    models, over the (query, key) pairs its blocks visit - every segment's tail over its whole
    key range, split into its own rows and the shared nodes it reads: its backward recomputes
    the scores (one more query . key product per pair), and under MLA the torch backend pads
    V to the query head dim (three more products per pair with the zero channels)."""
    q, kv = plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host
    pairs = sum((q[i + 1] - q[i]) * (kv[i + 1] - kv[i]) for i in range(len(q) - 1))
    q_dim, v_dim = ((preset.head_dim, preset.head_dim) if preset.mla is None
                    else (preset.mla.q_head_dim, preset.mla.v_head_dim))
    per_pair = 2 * preset.num_attention_heads * preset.num_layers
    return per_pair * (q_dim + 3 * (q_dim - v_dim)) * pairs


@pytest.mark.parametrize("preset, workload",
                         [(PRESET, w) for w in WORKLOADS]
                         + [(m, MLA_WORKLOAD) for m in (MLA, SMALL_MLA)],
                         ids=[*WORKLOADS, *(f"{m.name}-{MLA_WORKLOAD}" for m in (MLA, SMALL_MLA))])
def test_the_model_counts_what_torch_counts_plain_and_shared(counted, preset, workload):
    batches, flops = counted
    plan = build_plan(batches[workload], CONFIG)
    model = count_flops(plan, preset)
    assert plan.num_padding == 0 and plan.has_sharing
    plain, shared = flops[preset.name, workload, "packed"], flops[preset.name, workload, "shared"]
    assert set(plain) == {"aten.mm", "aten.bmm"}  # nothing else multiplies
    assert set(shared) == {"aten.mm", *map(str, _cpu_flash_formulas())}
    tails = (plan.cu_seqlens_q[1:] - plan.cu_seqlens_q[:-1]).tolist()
    padded_v = 0  # the stock THD step's products with V's zero channels (0.19+, MLA)
    if preset.mla is not None and flops["stock_thd_pads_v"]:
        pad = preset.mla.q_head_dim - preset.mla.v_head_dim
        padded_v = 3 * 2 * preset.num_attention_heads * pad * preset.num_layers * sum(
            n * n for n in plan.seq_lens)
    assert (sum(plain.values()) - _masked_pair_flops(list(plan.seq_lens), preset) - padded_v
            == model.plain)
    assert (sum(shared.values()) - _masked_pair_flops(tails, preset)
            - _fused_kernel_extra_flops(plan, preset) == model.shared)


def test_the_flop_ratio_users_read_is_the_measured_one(counted):
    """The "flop x" column: within a few % of the counted ratio even before the masked halves
    are taken out, and exact after."""
    batches, flops = counted
    for workload, sequences in batches.items():
        plan = build_plan(sequences, CONFIG)
        measured = (sum(flops[PRESET.name, workload, "packed"].values())
                    / sum(flops[PRESET.name, workload, "shared"].values()))
        assert count_flops(plan, PRESET).ratio == pytest.approx(measured, rel=0.05)


def test_windowed_layers_count_the_pairs_inside_the_window():
    """Per layer, the (query, key) pairs a band allows: counted by brute force over every
    computed token's position, plain and shared, on the tiny-window preset's layers."""
    model = get_preset("tiny-window")
    full = dataclasses.replace(model, window_size=None)
    sequences = make_workload("grpo", vocab_size=model.vocab_size, num_prompts=2,
                              group_size=4).sequences
    plan = build_plan(sequences, CONFIG)
    per_pair = 3 * 4 * model.num_attention_heads * model.head_dim

    def pairs(positions_per_segment, window):
        return sum(min(p + 1, window or p + 1) for ps in positions_per_segment for p in ps)

    plain_positions = [range(n) for n in plan.seq_lens]
    q, kv = plan.cu_seqlens_q_host, plan.cu_seqlens_kv_host
    shared_positions = [range(kv[i + 1] - kv[i] - (q[i + 1] - q[i]), kv[i + 1] - kv[i])
                        for i in range(len(q) - 1)]
    windows = [model.layer_window(layer) for layer in range(1, model.num_layers + 1)]
    assert windows == [16, None, 16, None]
    saved = [sum(pairs(pos, None) - pairs(pos, w) for w in windows)
             for pos in (plain_positions, shared_positions)]
    assert saved[1] > 0  # the workload's tails reach past the window
    ours, theirs = count_flops(plan, model), count_flops(plan, full)
    assert theirs.plain - ours.plain == per_pair * saved[0]
    assert theirs.shared - ours.shared == per_pair * saved[1]


def test_recurrent_layers_are_counted_per_token():
    """A Gated DeltaNet hybrid: its recurrent layers cost the same per computed token whatever
    the sharing (no (query, key) pairs), so their share of the count saves exactly the token
    ratio, and the more of them, the closer the hybrid's ratio to the token ratio."""
    from prefix_sharing.presets import PRESETS

    hybrid = PRESETS["tiny-hybrid"]  # 3 recurrent layers, 1 attention layer
    plan = build_plan(make_workload("tree", vocab_size=hybrid.vocab_size).sequences, CONFIG)
    none = build_plan(make_workload("none", vocab_size=hybrid.vocab_size).sequences, CONFIG)
    assert count_flops(none, hybrid).ratio == 1.0
    ratio = count_flops(plan, hybrid).ratio
    # 7 recurrent layers to 1 attention layer; and the same stack all attention (gated)
    more = count_flops(plan, dataclasses.replace(hybrid, num_layers=8, full_attention_every=8))
    attention = count_flops(plan, dataclasses.replace(hybrid, full_attention_every=1))
    assert attention.plain != count_flops(plan, hybrid).plain
    low, high = sorted([plan.token_ratio, attention.ratio])
    assert low < ratio < high
    assert abs(more.ratio - plan.token_ratio) < abs(ratio - plan.token_ratio)


def test_mamba_hybrid_layers_count_what_torch_counts():
    """Nemotron-H (tiny-nemotron-h, pattern ``M-M*E``): the linear layers the model counts per
    token - Mamba-2 input/output projections, attention, non-gated MLP, MoE router, top-k and
    shared experts, LM head - are the matrix products torch counts on transformers' own
    forward (``aten.mm``); the mixers' convolution and SSD scan, counted on top, are per token
    too, so the count's ratio lies between the token ratio and the same stack's attention-only
    ratio, and a batch without sharing has ratio 1."""
    pytest.importorskip("transformers.models.nemotron_h")
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from prefix_sharing.flops import _SSD_CHUNK, _mamba_hybrid_layer_macs
    from prefix_sharing.fsdp_compat import build_model

    preset = get_preset("tiny-nemotron-h")
    model = build_model("nemotron_h", preset)
    model.set_experts_implementation("eager")  # one F.linear per expert: products torch sees
    # from transformers 5.25 the mixers call their convolution through a module taking the
    # weights as inputs; torch's module tracker (FlopCounterMode) cannot hook inputs that
    # require grad under no_grad, so none does here
    model.requires_grad_(False)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.arange(1, 38)[None], use_cache=False)
    mamba = preset.mamba
    conv_width = mamba.inner_size + 2 * mamba.n_groups * mamba.state_size  # x, B, C
    scan_and_conv = (mamba.num_heads * (2 * mamba.head_dim * mamba.state_size
                                        + _SSD_CHUNK * (mamba.state_size + mamba.head_dim) // 2)
                     + mamba.conv_kernel * conv_width)
    macs = _mamba_hybrid_layer_macs(preset)
    linear = (sum(macs[kind] for kind in mamba.pattern) - mamba.num_mixers * scan_and_conv
              + preset.hidden_size * preset.vocab_size)
    assert counter.get_flop_counts()["Global"][torch.ops.aten.mm] == 2 * linear * 37

    plan = build_plan(make_workload("tree", vocab_size=preset.vocab_size).sequences, CONFIG)
    none = build_plan(make_workload("none", vocab_size=preset.vocab_size).sequences, CONFIG)
    assert count_flops(none, preset).ratio == 1.0
    attention = dataclasses.replace(preset, mamba=dataclasses.replace(mamba, pattern="*-**E"))
    assert plan.token_ratio > count_flops(plan, preset).ratio > count_flops(plan, attention).ratio
