"""The support matrix: feature x engine (x release), each cell shown by a test or a refusal.

A cell *works* (naming the test files that compare it with the plain forward, and the releases
they run on where it depends on one), is *refused* (naming the keys of :mod:`.refusals`),
*untested* (nothing here runs it), or *not offered* (the engine has no such setting). A cell
that works may still name refusals: what stays refused around it (another release, another
layout). ``tests/test_refusals.py`` checks that every named test file exists and every key is
registered and applies to the cell's engine; ``docs/support.md`` and the README's glance table
are generated from this module and :data:`~.refusals.REFUSALS` by
``scripts/docs/support_matrix.py`` (``--check`` says whether they are current), as is the
table of what runs across micro-batches in ``docs/cross-micro-batch.md``
(:data:`CROSS_MATRIX`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from .refusals import REFUSALS
from .verl_ext.recipes import render_section as render_recipe_section


__all__ = ["COLUMNS", "CROSS_COLUMNS", "CROSS_MATRIX", "MATRIX", "STATUSES", "Cell",
           "cross_page_with_table", "readme_with_table", "render_cross_table", "render_page",
           "render_readme_table"]

# The engines a user picks (columns), as the refusal table names them, and their headers.
COLUMNS = {"megatron-core": "Megatron-core", "verl-megatron": "verl, Megatron engine",
           "verl-fsdp": "verl, FSDP engine", "hf-fsdp": "HF / FSDP2",
           "megatron-lm": "Megatron-LM loop"}
STATUSES = ("works", "refused", "untested", "not offered")


@dataclass(frozen=True)
class Cell:
    """One feature on one engine: ``status`` (one of :data:`STATUSES`), the ``tests`` that show
    it works, the ``refusals`` (keys) that refuse it or its limits, the ``releases`` it depends
    on, and a short ``note`` for the README's glance table."""

    status: str
    tests: tuple[str, ...] = ()
    refusals: tuple[str, ...] = ()
    releases: str = ""
    note: str = ""


def works(*tests: str, refusals: tuple[str, ...] = (), releases: str = "", note: str = "") -> Cell:
    return Cell("works", tests, refusals, releases, note)


def refused(*keys: str, note: str = "") -> Cell:
    return Cell("refused", refusals=keys, note=note)


UNTESTED = Cell("untested")
NOT_OFFERED = Cell("not offered")

_MX = "tests/megatron_ext/"
_VX = "tests/verl_ext/"
_FX = "tests/fsdp_compat/"
_LM = "tests/megatron_lm/test_training.py"

MATRIX: dict[str, dict[str, Cell]] = {
    "dense GPT (GQA, RoPE, YaRN, qk-norm)": {
        "megatron-core": works(_MX + "test_equivalence.py"),
        "verl-megatron": works(_VX + "test_verl091_engine.py", _VX + "test_verl080_engine.py",
                               _VX + "test_mcore_fused.py", _VX + "test_mcore_rope_fusion.py",
                               releases="verl 0.9.1, 0.8.0", refusals=("verl.fused_kernels",),
                               note="use_fused_kernels and apply_rope_fusion served (verl 0.9.1)"),
        # log-probs from hidden states in chunks: use_fused_kernels and the entropy knobs served
        "verl-fsdp": works(_VX + "test_fsdp_engine.py", _VX + "test_fsdp_families.py",
                           _VX + "test_fsdp_fused.py", releases="verl 0.9.1, 0.8.0; FSDP1, FSDP2",
                           note="FSDP1, FSDP2; Qwen2.5, Qwen3, Mistral, Gemma, Seed-OSS, Llama"),
        "hf-fsdp": works(_FX + "test_forward.py", refusals=("hf.residual_dropout",)),
        "megatron-lm": works(_LM),
    },
    "TP / SP, PP": {
        "megatron-core": works(_MX + "test_equivalence.py", _MX + "test_sequence_parallel.py"),
        "verl-megatron": works(_VX + "test_verl091_engine.py"),
        "verl-fsdp": works(_VX + "test_fsdp_engine.py", note="FSDP1, FSDP2"),
        "hf-fsdp": works(_FX + "test_fsdp.py", note="FSDP2"),
        "megatron-lm": works(_LM),
    },
    "verl's padded layout (use_remove_padding: false)": {
        "megatron-core": NOT_OFFERED,
        "verl-megatron": works(_VX + "test_microbatch_engine.py", releases="verl 0.9.1, 0.8.0",
                               note="against verl's packed step (its bshd step needs TE)"),
        "verl-fsdp": works(_VX + "test_fsdp_engine.py", releases="verl 0.9.1, 0.8.0"),
        "hf-fsdp": NOT_OFFERED,
        "megatron-lm": NOT_OFFERED,
    },
    "verl's micro-batches: dynamic, fixed (groups kept whole)": {
        "megatron-core": NOT_OFFERED,
        "verl-megatron": works(_VX + "test_microbatch_engine.py", _VX + "test_microbatch.py",
                               _VX + "test_verl_recipes_megatron.py",
                               releases="verl 0.9.1, 0.8.0",
                               note="fixed: reordered where the loss allows; a MoE router "
                                    "loss keeps verl's split"),
        "verl-fsdp": works(_VX + "test_fsdp_engine.py", _VX + "test_microbatch.py",
                           releases="verl 0.9.1, 0.8.0",
                           note="fixed: reordered where the loss allows"),
        "hf-fsdp": NOT_OFFERED,
        "megatron-lm": NOT_OFFERED,
    },
    "SFT (verl: engine.use_prefix_grouper)": {
        "megatron-core": NOT_OFFERED,
        "verl-megatron": works(_VX + "test_sft_engine.py", releases="verl 0.9.1, 0.8.0",
                               note="its SFT step, TP=1"),
        "verl-fsdp": works(_VX + "test_sft_engine.py", _VX + "test_fsdp_ulysses.py",
                           _VX + "trainer/test_sft_trainer.py",
                           releases="verl 0.9.1, 0.8.0; the trainer run 0.9.1",
                           note="FSDP2, also under Ulysses; verl's sft_trainer end to end"),
        "hf-fsdp": NOT_OFFERED,
        "megatron-lm": works(_LM, note="SFT conversations"),
    },
    "interleaved (virtual) PP": {
        "megatron-core": works(_MX + "test_virtual_pipeline.py",
                               _MX + "test_cross_micro_batch_pipeline.py",
                               refusals=("megatron.virtual_pipeline.two_stage_p2p",),
                               releases="megatron-core 0.16.1, 0.19.2",
                               note="PP=2 x VPP=2, uneven stages; across micro-batches too"),
        "verl-megatron": works(_VX + "test_verl091_engine.py", _VX + "test_cross_pipeline.py",
                               releases="verl 0.9.1",
                               refusals=("megatron.virtual_pipeline.two_stage_p2p",),
                               note="PP=2 x VPP=2; across micro-batches too"),
        "verl-fsdp": NOT_OFFERED,
        "hf-fsdp": NOT_OFFERED,
        "megatron-lm": refused("megatron_lm.virtual_pipeline"),
    },
    "context parallelism": {
        "megatron-core": works(_MX + "test_context_parallel.py",
                               refusals=("megatron.context_parallel.unplanned_input",)),
        "verl-megatron": works(_VX + "test_context_parallel.py",
                               refusals=("verl.dynamic_context_parallel",)),
        "verl-fsdp": works(_VX + "test_fsdp_ulysses.py", _FX + "test_ulysses.py",
                           releases="verl 0.9.1, 0.8.0", note="Ulysses 2, 4",
                           refusals=("verl.ulysses.recurrent", "verl.ulysses.vlm")),
        "hf-fsdp": NOT_OFFERED,
        "megatron-lm": refused("megatron_lm.context_parallel"),
    },
    "MoE (exact router statistics), EP": {
        "megatron-core": works(_MX + "test_moe.py", _MX + "test_context_parallel_moe.py",
                               refusals=("megatron.moe.capacity_factor", "megatron.moe.sinkhorn")),
        "verl-megatron": works(_VX + "test_routing_replay.py"),
        "verl-fsdp": works(_VX + "test_fsdp_families.py", _VX + "test_fsdp_hybrid.py",
                           _VX + "test_fsdp_vlm.py", releases="verl 0.9.1, 0.8.0",
                           note="Qwen3-MoE, gpt-oss, Qwen3-Next, Qwen3.5-MoE, Qwen3-VL-MoE"),
        "hf-fsdp": works(_FX + "test_moe.py", note="Qwen3-MoE, gpt-oss"),
        "megatron-lm": UNTESTED,
    },
    "routing replay": {
        "megatron-core": works(_MX + "test_routing_replay.py",
                               refusals=("megatron.moe.replay_router_fusion",)),
        "verl-megatron": works(_VX + "test_routing_replay.py", note="R2, R3",
                               refusals=("verl.routing_replay.r2_context_parallel",)),
        "verl-fsdp": NOT_OFFERED,
        "hf-fsdp": NOT_OFFERED,
        "megatron-lm": NOT_OFFERED,
    },
    "MLA (DeepSeek-V3 shape)": {
        "megatron-core": works(_MX + "test_mla.py"),
        "verl-megatron": works(_VX + "test_mcore_mla.py", releases="verl 0.9.1",
                               note="TP=2 with SP, MoE with a shared expert"),
        "verl-fsdp": NOT_OFFERED,
        "hf-fsdp": NOT_OFFERED,
        "megatron-lm": UNTESTED,
    },
    "sliding windows, sinks": {
        "megatron-core": works(_MX + "test_window.py",
                               refusals=("megatron.window_reads_later_keys",)),
        "verl-megatron": UNTESTED,
        "verl-fsdp": works(_VX + "test_fsdp_windowed.py", _VX + "test_fsdp_families.py",
                           note="Gemma 3, gpt-oss"),
        "hf-fsdp": works(_FX + "test_windowed_families.py", note="gpt-oss, Gemma 3 / 4"),
        "megatron-lm": UNTESTED,
    },
    "Gated DeltaNet hybrids": {
        "megatron-core": works(_MX + "test_gated_delta_net.py", releases="megatron-core 0.19.2",
                               note="megatron-core 0.19.2",
                               refusals=("megatron.gdn_release", "megatron.gdn.context_parallel")),
        "verl-megatron": works(_VX + "test_verl091_mcore0192_hybrid.py",
                               releases="verl 0.9.1, megatron-core 0.19.2",
                               note="0.19.2 (verl 0.9.1)",
                               refusals=("verl.gdn_release",)),
        "verl-fsdp": works(_VX + "test_fsdp_hybrid.py", note="Qwen3.5, Qwen3-Next"),
        "hf-fsdp": works(_FX + "test_gated_deltanet.py", note="Qwen3.5, Qwen3-Next",
                         refusals=("hf.mtp",)),
        "megatron-lm": UNTESTED,
    },
    "Mamba-2 hybrids": {
        "megatron-core": refused("megatron.hybrid_layer"),
        "verl-megatron": refused("megatron.hybrid_layer"),
        "verl-fsdp": UNTESTED,
        "hf-fsdp": works(_FX + "test_nemotron_h.py", note="Nemotron-H",
                         refusals=("hf.recurrent_family",)),
        "megatron-lm": refused("megatron_lm.spec"),
    },
    "across micro-batches": {
        "megatron-core": works(_MX + "test_cross_micro_batch.py",
                               _MX + "test_cross_micro_batch_pipeline.py",
                               _MX + "test_cross_micro_batch_replay.py",
                               _MX + "test_cross_micro_batch_context_parallel.py",
                               note="PP=2 (x VPP=2); CP=2 (x TP=2, x PP=2); MoE "
                                    "statistics at CP=2 and PP=2; windows at PP=2"),
        "verl-megatron": works(_VX + "test_cross_forward.py", _VX + "test_cross_nested.py",
                               _VX + "test_cross_replay.py",
                               _VX + "test_cross_moe_sequence_parallel.py",
                               _VX + "test_cross_pipeline.py",
                               note="PP=2 (x TP=2, x CP=2, x VPP=2); CP=2 (x TP=2); "
                                    "MoE and routing replay at PP=2, MoE at CP=2; "
                                    "nested: x TP=2, x CP=2, x PP=2 (x VPP=2), MoE, replay, "
                                    "recompute"),
        "verl-fsdp": works(_VX + "test_fsdp_cross.py",
                           note="FSDP2 and FSDP1; Ulysses 2; one level and nested; gradient "
                                "checkpointing; no vision-language model",
                           refusals=("verl.cross_micro_batch.recurrent", "verl.multimodal")),
        "hf-fsdp": NOT_OFFERED,
        "megatron-lm": Cell("not offered", note="not wired"),
    },
    "vision-language models (images shared with their prefix)": {
        "megatron-core": refused("megatron.mrope"),
        "verl-megatron": refused("verl.megatron_vlm", note="refused: verl's VLM bridges need TE"),
        "verl-fsdp": works(_VX + "test_fsdp_vlm.py", releases="verl 0.9.1",
                           note="Qwen2.5-VL, Qwen3-VL (+MoE), Qwen3.5 (+MoE); no video, "
                                "GLM-4.1V, MiniCPM-o; against verl's padded step",
                           refusals=("verl.multimodal", "verl.self_check.vlm", "hf.vlm_release",
                                     "hf.video")),
        "hf-fsdp": works(_FX + "test_vlm.py", _FX + "test_vlm_inputs.py", _FX + "test_fsdp.py",
                         releases="transformers 5.10, 5.24",
                         note="Qwen2.5-VL, Qwen3-VL (+MoE), Qwen3.5 (+MoE); no video",
                         refusals=("hf.vlm_release", "hf.video", "hf.stock_vision_features",
                                   "hf.images_for_text_model")),
        "megatron-lm": refused("megatron_lm.model_argument"),
    },
    "LoRA (PEFT adapters)": {
        "megatron-core": NOT_OFFERED,
        "verl-megatron": refused("verl.megatron_lora",
                                 note="refused: verl's Megatron LoRA needs TE"),
        "verl-fsdp": works(_VX + "test_fsdp_lora.py", releases="verl 0.9.1, 0.8.0",
                           note="PEFT; the reference with adapters off"),
        "hf-fsdp": works(_FX + "test_lora.py", note="PEFT: active, disabled, merged"),
        "megatron-lm": NOT_OFFERED,
    },
    "the critic (value model: PPO / GAE)": {
        "megatron-core": NOT_OFFERED,
        "verl-megatron": works(_VX + "test_critic.py", releases="verl 0.9.1, 0.8.0",
                               note="TP=1; TP=2 with sequence parallelism; across "
                                    "micro-batches (verl 0.9.1)",
                               refusals=("verl.critic.sequence_split",
                                         "verl.self_check.value_model")),
        "verl-fsdp": works(_VX + "test_critic.py", releases="verl 0.9.1, 0.8.0",
                           note="FSDP1, FSDP2", refusals=("verl.critic.sequence_split",
                                                          "verl.self_check.value_model")),
        "hf-fsdp": UNTESTED,
        "megatron-lm": NOT_OFFERED,
    },
    "verl's VeOmni, AutoModel and TorchTitan engines": {
        "megatron-core": NOT_OFFERED,
        "verl-megatron": NOT_OFFERED,
        "verl-fsdp": refused("verl.unhooked_engine",
                             note="refused: use model_engine=fsdp or megatron"),
        "hf-fsdp": NOT_OFFERED,
        "megatron-lm": NOT_OFFERED,
    },
    "attention dropout, mrope / multimodal": {
        "megatron-core": refused("megatron.attention_dropout", "megatron.mrope"),
        "verl-megatron": refused("megatron.attention_dropout", "verl.multimodal",
                                 "verl.megatron_vlm"),
        "verl-fsdp": refused("hf.attention_dropout", "verl.multimodal"),
        "hf-fsdp": refused("hf.attention_dropout", "hf.multimodal"),
        "megatron-lm": refused("megatron.attention_dropout", "megatron_lm.model_argument"),
    },
    "multi-token prediction (MTP)": {
        "megatron-core": works("tests/megatron_ext/test_mtp.py", refusals=("megatron.mtp",),
                               note="dense and MoE MTP layers, TP / SP / PP / VPP / CP"),
        "verl-megatron": works("tests/verl_ext/test_mcore_mtp.py",
                               refusals=("verl.mtp", "megatron.mtp"),
                               note="verl's mtp.enable_train: TP / SP / PP / VPP / CP"),
        "verl-fsdp": refused("verl.mtp"),
        "hf-fsdp": refused("hf.mtp"),
        "megatron-lm": works(_LM, refusals=("megatron.mtp",), note="--mtp-num-layers, TP=1 / PP=2"),
    },
}

# What runs across micro-batches (prefix_grouper.cross_micro_batch), setting x driver: the
# library's group driver and verl's Megatron engines (verl's FSDP engine refuses the option:
# MATRIX's "across micro-batches" row).
CROSS_COLUMNS = {"megatron-core": "the group driver (megatron-core)",
                 "verl-megatron": "verl's Megatron engine"}
CROSS_MATRIX: dict[str, dict[str, Cell]] = {
    "one level (the prefix kept, or recomputed)": {
        "megatron-core": works(_MX + "test_cross_micro_batch.py"),
        "verl-megatron": works(_VX + "test_cross_forward.py", note="the prefix kept"),
    },
    "nested (a chunked prefix, sub-tree blocks)": {
        "megatron-core": works(_MX + "test_cross_micro_batch_nested.py",
                               _MX + "test_cross_micro_batch_pipeline.py",
                               note="PP=1; PP=2 (each step a micro-batch)"),
        "verl-megatron": works(_VX + "test_cross_nested.py", _VX + "test_cross_replay.py",
                               _VX + "test_cross_pipeline.py",
                               note="TP=2, CP=2, PP=2, windows, recompute, MoE, "
                                    "routing replay"),
    },
    "TP, sequence parallelism": {
        "megatron-core": works(_MX + "test_cross_micro_batch.py",
                               _MX + "test_cross_micro_batch_settings.py", note="TP=2"),
        "verl-megatron": works(_VX + "test_cross_forward.py", _VX + "test_cross_nested.py",
                               note="TP=2"),
    },
    "context parallelism": {
        "megatron-core": works(_MX + "test_cross_micro_batch_context_parallel.py",
                               note="CP=2, x TP=2"),
        "verl-megatron": works(_VX + "test_cross_forward.py", note="CP=2, x TP=2"),
    },
    "pipeline parallelism (1F1B)": {
        "megatron-core": works(_MX + "test_cross_micro_batch_pipeline.py",
                               note="PP=2, x TP=2, x CP=2; nested at PP=2, x TP=2, x CP=2, "
                                    "with MoE"),
        "verl-megatron": works(_VX + "test_cross_pipeline.py",
                               note="PP=2, x TP=2, x CP=2; one level and nested"),
    },
    "interleaved (virtual) pipeline stages": {
        "megatron-core": works(_MX + "test_cross_micro_batch_pipeline.py",
                               note="PP=2 x VPP=2, one level and nested"),
        "verl-megatron": works(_VX + "test_cross_pipeline.py", note="PP=2 x VPP=2, one level"),
    },
    "activation recompute (full, selective)": {
        "megatron-core": works(_MX + "test_cross_micro_batch_settings.py",
                               _MX + "test_cross_micro_batch_context_parallel.py",
                               _MX + "test_cross_micro_batch_pipeline.py"),
        "verl-megatron": works(_VX + "test_cross_forward.py", _VX + "test_cross_pipeline.py",
                               _VX + "test_cross_nested.py"),
    },
    "sliding windows, sinks": {
        "megatron-core": works(_MX + "test_cross_micro_batch_settings.py",
                               _MX + "test_cross_micro_batch_context_parallel.py"),
        "verl-megatron": works(_VX + "test_cross_forward.py", _VX + "test_cross_pipeline.py",
                               _VX + "test_cross_nested.py"),
    },
    "MoE router statistics": {
        "megatron-core": works(_MX + "test_cross_micro_batch.py",
                               _MX + "test_cross_micro_batch_context_parallel.py",
                               _MX + "test_cross_micro_batch_pipeline.py",
                               note="TP x SP, CP, PP, CP x PP, nested at PP=2"),
        "verl-megatron": works(_VX + "test_cross_forward.py", _VX + "test_cross_pipeline.py",
                               _VX + "test_cross_moe_sequence_parallel.py",
                               note="TP x SP, CP, PP; verl's own step counts its pad rows"),
    },
    "routing replay": {
        "megatron-core": works(_MX + "test_cross_micro_batch_replay.py", note="PP=1, PP=2"),
        "verl-megatron": works(_VX + "test_cross_replay.py", releases="verl 0.9.1",
                               note="R3 and R2; R3 at PP=2",
                               refusals=("verl.routing_replay.padded_statistics",)),
    },
    "the critic (values)": {
        "megatron-core": NOT_OFFERED,
        "verl-megatron": works(_VX + "test_critic.py", releases="verl 0.9.1",
                               note="PP=1, PP=2; 0.8.0's value_loss keeps verl's split"),
    },
}

BEGIN = "<!-- support matrix: generated by scripts/docs/support_matrix.py -->"
END = "<!-- /support-matrix -->"
CROSS_BEGIN = "<!-- cross-micro-batch table: generated by scripts/docs/support_matrix.py -->"
CROSS_END = "<!-- /cross-micro-batch-table -->"
_GLANCE = {"works": "yes", "refused": "refused", "untested": "untested", "not offered": "-"}


def _glance(cell: Cell) -> str:
    return cell.note or _GLANCE[cell.status]


def _table(cells: dict[str, dict[str, Cell]], show: Callable[[Cell], str],
           columns: dict[str, str] = COLUMNS) -> list[str]:
    lines = ["| | " + " | ".join(columns.values()) + " |", "|---" * (len(columns) + 1) + "|"]
    for feature, row in cells.items():
        lines.append(f"| {feature} | " + " | ".join(show(row[c]) for c in columns) + " |")
    return lines


def render_readme_table() -> str:
    """The README's glance table (between :data:`BEGIN` and :data:`END`)."""
    return "\n".join(_table(MATRIX, _glance))


def _detail(cell: Cell) -> str:
    status = cell.status + (f" ({cell.releases})" if cell.releases else "")
    if not cell.refusals:
        return status
    keys = ", ".join(f"`{key}`" for key in cell.refusals)
    return f"{status}; limits: {keys}" if cell.status == "works" else f"{status}: {keys}"


def render_page() -> str:
    """``docs/support.md``: the matrix, the evidence of each cell, and every refusal."""
    lines = [
        "# Support matrix and refusals",
        "",
        "<!-- generated by `python scripts/docs/support_matrix.py` from "
        "prefix_sharing/support.py and prefix_sharing/refusal_table.py; edit those, not this "
        "page (tests/test_refusals.py fails when it is stale) -->",
        "",
        "Each cell: **works** (a test compares it with the plain forward; the release it needs "
        "where it depends on one), **refused** (the keys below; the error names the setting and "
        "the key), **untested** (nothing here runs it) or **not offered** (the engine has no "
        "such setting). A working cell's *limits* are the refusals around it (another release, "
        "another layout). Every test here runs on CPU; no GPU run yet.",

        "",
        *_table(MATRIX, _detail),
        "",
        "## The tests behind each working cell",
        "",
    ]
    for feature, row in MATRIX.items():
        for column, cell in row.items():
            if cell.tests:
                tests = ", ".join(f"`{test}`" for test in cell.tests)
                lines.append(f"- {feature}, {COLUMNS[column]}: {tests}")
    lines += ["", *render_recipe_section()]
    lines += [
        "",
        "## Every refusal",
        "",
        "The message of each refused setup is `prefix sharing refuses <setting> (<what was "
        "found>): <reason> [<key>]`. Engines: where the check runs (`kernels`: the attention "
        "kernels any engine may pick; `cli`: the `prefix-sharing` command).",
        "",
        "| key | setting | reason | engines |",
        "|---|---|---|---|",
    ]
    for key, entry in sorted(REFUSALS.items()):
        reason = entry.reason.replace("|", "\\|")
        lines.append(f"| `{key}` | {entry.setting} | {reason} | {', '.join(entry.engines)} |")
    return "\n".join(lines) + "\n"


def render_cross_table() -> str:
    """docs/cross-micro-batch.md's table (between :data:`CROSS_BEGIN` and :data:`CROSS_END`):
    each setting on each driver, its status, limits, note and tests."""
    def show(cell: Cell) -> str:
        tests = ", ".join(f"`{t.rpartition('/')[2]}`" for t in cell.tests)
        return "; ".join(part for part in (_detail(cell), cell.note, tests) if part)

    return "\n".join(_table(CROSS_MATRIX, show, CROSS_COLUMNS))


def readme_with_table(readme: str) -> str:
    """``readme`` with its generated block replaced by :func:`render_readme_table`."""
    return _with_block(readme, BEGIN, END, render_readme_table(), "README.md")


def cross_page_with_table(page: str) -> str:
    """docs/cross-micro-batch.md (``page``) with its generated block replaced by
    :func:`render_cross_table`."""
    return _with_block(page, CROSS_BEGIN, CROSS_END, render_cross_table(),
                       "docs/cross-micro-batch.md")


def _with_block(text: str, begin: str, end: str, body: str, name: str) -> str:
    head, found_begin, rest = text.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        raise ValueError(f"{name} has no {begin} ... {end} block")
    return f"{head}{begin}\n{body}\n{end}{tail}"
