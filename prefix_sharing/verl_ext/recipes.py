"""verl 0.9's own example launches on every engine, reduced to the setting combinations that
matter to the sharing engines, each with its verdict.

The data: ``docs/results/verl-0.9-recipes.csv``, this project's own, one row per training
launch script under ``examples/`` of verl's ``release/v0.9.0`` branch (tip 885121936,
2026-08-20: the release line of verl 0.9.1; 107 launches, 92 RL and 15 SFT). The settings were
read statically from each script (bash variables resolved, the last hydra override wins, the
GPU branch taken) with verl 0.9.1's defaults where the script says nothing (``actor.strategy:
fsdp``, ``use_remove_padding: true``, ``use_dynamic_bsz: false``, ``use_fused_kernels: false``,
``use_torch_compile: true``). Columns read here: ``kind`` (rl / sft), ``loss_mode``, ``engine``,
``family``, ``vl``, ``ulysses``, ``rmpad``, ``dyn_bsz``, ``critic``, ``lora``, ``fused``,
``distill``, ``sum_pi2``, ``recompute`` (``gc:True``: gradient checkpointing),
``entropy_knobs`` and, on the Megatron engine, ``tp``, ``pp``, ``vpp``, ``cp``, ``ep``,
``rope_fusion``, ``mtp_train`` and ``router_replay``. The reader is approximate: open the
script before relying on one row.

:func:`combinations` reduces every row (FSDP: ``engine`` ``fsdp1`` / ``fsdp2`` / ``fsdp`` /
``fsdp(fsdp2)``, an unresolved ``fsdp`` being verl's default, FSDP1; Megatron and MindSpeed,
verl's Megatron engine on Ascend; VeOmni; AutoModel; megatron-lite, which verl 0.9.1 does not
have) to their distinct :class:`Combination` of what changes the sharing engine's step or its
verdict: strategy, model family (and its
vision tower), Ulysses (any size > 1 is run at 2), ``use_remove_padding``, ``use_dynamic_bsz``,
``use_fused_kernels``, the entropy switches, gradient checkpointing, the policy loss mode, LoRA,
distillation, ``calculate_sum_pi_squared``, the critic, the trainer (RL or SFT) and the
Megatron engine's parallel sizes (any size > 1 read as 2), rope fusion, MTP training and router
replay. The
advantage estimator is left out: advantages are the loss's inputs, the engine never sees how they
were made. Every row maps to exactly one combination (``tests/verl_ext/test_recipes.py``).

:meth:`Combination.verdict` is what the sharing engine does with it - served, or the refusal
keys and why - which the recipe tests check against the engine and ``preflight``, and
``docs/support.md`` lists (:func:`render_section`).
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
from collections.abc import Iterable

__all__ = ["CSV", "Combination", "Row", "combinations", "fsdp_rows", "read_rows",
           "render_section"]

CSV = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "verl-0.9-recipes.csv"
FSDP_ENGINES = {"fsdp1": "fsdp", "fsdp": "fsdp", "fsdp2": "fsdp2", "fsdp(fsdp2)": "fsdp2"}
# the CSV's engine -> verl's strategy (backend); MindSpeed is verl's Megatron engine on Ascend
# (registered under the backend megatron for npu); megatron-lite / mlite is no engine verl
# 0.9.1 registers (its launches come from the release branch's tip)
ENGINES = {**FSDP_ENGINES, "megatron": "megatron", "mindspeed": "megatron", "veomni": "veomni",
           "automodel": "automodel", "megatron-lite": "megatron_lite", "mlite": "megatron_lite"}
MEGATRON = {"megatron"}
# the strategies verl 0.9.1 has an engine (or a config) for
ENGINES_IN_VERL = {"fsdp", "fsdp2", "megatron", "veomni", "automodel"}
# backends whose launches name no family the reduction can read: any config stands in (the
# engine is refused whatever the model)
# recipe family -> the HF model type of its checkpoints
MODEL_TYPES = {
    "qwen2.5": "qwen2", "qwen3": "qwen3", "qwen3-moe": "qwen3_moe", "qwen3-next": "qwen3_next",
    "gpt-oss": "gpt_oss", "mistral": "mistral", "gemma": "gemma", "seed-oss": "seed_oss",
    "deepseek-coder(llama)": "llama", "qwen2.5-vl": "qwen2_5_vl", "qwen3-vl": "qwen3_vl",
    "qwen3-vl-moe": "qwen3_vl_moe", "qwen3.5": "qwen3_5", "qwen3.5-moe": "qwen3_5_moe",
    "glm4.1v": "glm4v", "minicpm-o": "minicpmo", "deepseek-v3": "deepseek_v3",
    "moonlight(deepseek-v3 arch)": "deepseek_v3", "deepseek-v4": "deepseek_v4",
    "hunyuan": "hy_v3", "nemotron-h": "nemotron_h", "mimo": "mimo", "?": "unknown",
}
# model types transformers has no config of: checked on a stand-in config (MiMo is Qwen2's
# architecture with MTP layers; an unread family only meets a refused engine), with these
# fields of the model's own config
STAND_IN_TYPES = {"mimo": "qwen2", "unknown": "qwen2"}
STAND_IN_FIELDS = {"mimo": {"num_nextn_predict_layers": 1}}
# model types whose vision tower verl's Megatron engine refuses (verl.megatron_vlm), and whose
# Gated DeltaNet layers need a newer megatron-core than verl 0.9.1's (verl.gdn_release)
GDN = {"qwen3_5", "qwen3_5_moe", "qwen3_next"}
# what the Megatron engine's sharing layers refuse when they are built, said at construction
# from the model's configs (prefix_sharing.verl_ext.mcore_model): model types with Mamba-2
# layers (megatron.hybrid_layer), with DeepSeek sparse attention (megatron.dsa: V3.2's DSA,
# V4's compressed sparse attention), with multi-latent attention (megatron.rope_fusion with
# apply_rope_fusion), and MTP layers under routing replay (megatron.mtp)
MAMBA_HYBRIDS = {"nemotron_h"}
SPARSE_ATTENTION = {"deepseek_v32", "deepseek_v4"}
MLA = {"deepseek_v3"}
# verl's distillation losses that read the teacher's top-k log-probs: verl's trainer sets
# ``distillation_use_topk`` on every actor batch, a micro-batch switch the engines refuse
TOPK_DISTILLATION = {"forward_kl_topk"}
# the verdict's keys raised after construction: per micro-batch
BUILD_KEYS = {"verl.micro_batch_switch"}
# model types whose layers the sharing engine switches to a sharing recurrence (Gated DeltaNet)
RECURRENT = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
# vision-language model types the FSDP engine refuses (prefix_sharing.verl_ext.vlm)
UNSERVED_VLM = {"glm4v", "minicpmo"}
TEST = "tests/verl_ext/test_verl_recipes.py"
# the keys the sharing layers also raise when the model is built (the recipe test builds it,
# but for a hybrid stack, which needs megatron-core 0.18+: tests/megatron_ext/test_hybrid.py)
MODEL_BUILD_KEYS = {"megatron.dsa", "megatron.mtp", "megatron.rope_fusion",
                    "megatron.hybrid_layer"}
MEGATRON_TEST = "tests/verl_ext/test_verl_recipes_megatron.py"
SFT_TESTS = "tests/verl_ext/test_sft_engine.py, tests/verl_ext/trainer/test_sft_trainer.py"
VLM_TESTS = ("test_fsdp_vlm.py (FSDP2), test_fsdp_engine.py (FSDP1), test_fsdp_fused.py, "
             "test_fsdp_lora.py")


@dataclasses.dataclass(frozen=True)
class Row:
    """One launch script's row (the columns the reduction reads)."""

    script: str
    fields: dict


def read_rows(path: pathlib.Path = CSV) -> list[Row]:
    with open(path, newline="") as handle:
        return [Row(r["script"], r) for r in csv.DictReader(handle)]


def all_rows(rows: Iterable[Row] | None = None) -> list[Row]:
    return read_rows() if rows is None else list(rows)


def fsdp_rows(rows: Iterable[Row] | None = None) -> list[Row]:
    """The rows on verl's FSDP engine (FSDP1, FSDP2, or the unresolved default)."""
    return [r for r in (read_rows() if rows is None else rows)
            if r.fields["engine"] in FSDP_ENGINES]


@dataclasses.dataclass(frozen=True, order=True)
class Combination:
    """The settings of one or more launches that the sharing engine's step depends on."""

    trainer: str  # "rl" or "sft"
    strategy: str  # verl's actor.strategy: "fsdp" (FSDP1) or "fsdp2"
    family: str  # the recipe's family name (MODEL_TYPES)
    vision: bool
    ulysses: int  # 1, or 2 for any size > 1
    remove_padding: bool
    dynamic_bsz: bool
    fused_kernels: bool
    chunked_entropy: bool
    entropy_checkpointing: bool
    torch_compile: bool
    gradient_checkpointing: bool
    loss_mode: str  # actor.policy_loss.loss_mode
    lora: bool
    distillation: str  # the distillation loss mode, "" without
    sum_pi_squared: bool
    critic: bool
    # the Megatron engine's settings (sizes above 1 read as 2; 1 on the other engines)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: bool = False
    context_parallel: int = 1
    expert_parallel: int = 1
    rope_fusion: bool = False
    mtp_train: bool = False
    router_replay: str = ""  # "", "R2" or "R3"

    @classmethod
    def of(cls, row: Row) -> Combination:
        f = row.fields
        knobs = f["entropy_knobs"].split()
        strategy = ENGINES[f["engine"]]
        megatron = strategy in MEGATRON

        def size(column: str) -> int:
            return 2 if megatron and int(f[column]) > 1 else 1

        return cls(
            tensor_parallel=size("tp"), pipeline_parallel=size("pp"),
            virtual_pipeline=megatron and int(f["vpp"]) > 1, context_parallel=size("cp"),
            expert_parallel=size("ep"), rope_fusion=megatron and f["rope_fusion"] == "1",
            mtp_train=f["mtp_train"] == "1", router_replay=f["router_replay"],
            trainer=f["kind"], strategy=strategy, family=f["family"],
            vision=f["vl"] == "1", ulysses=2 if int(f["ulysses"]) > 1 else 1,
            remove_padding=f["rmpad"] == "1", dynamic_bsz=f["dyn_bsz"] == "1",
            fused_kernels=f["fused"] == "1", chunked_entropy="chunked_entropy" in knobs,
            entropy_checkpointing="entropy_ckpt" in knobs,
            torch_compile="torch_compile=False" not in knobs,  # verl's default: on
            gradient_checkpointing="gc:True" in f["recompute"],
            loss_mode=f["loss_mode"] or "vanilla", lora=f["lora"] == "1",
            distillation=f["distill"], sum_pi_squared=f["sum_pi2"] == "1",
            critic=f["critic"] == "1")

    @property
    def model_type(self) -> str:
        return MODEL_TYPES[self.family]

    @property
    def name(self) -> str:
        """A short id: the family, strategy and each switch that differs from the plain RL
        step (FSDP2 ... remove padding on, the rest off, vanilla loss)."""
        parts = [self.family.split("(")[0].replace("?", "any"),
                 "fsdp1" if self.strategy == "fsdp" else self.strategy]
        parts += [f"sp{self.ulysses}"] if self.ulysses > 1 else []
        flags = (("padded", not self.remove_padding), ("dyn", self.dynamic_bsz),
                 ("fused", self.fused_kernels), ("chunked", self.chunked_entropy),
                 ("entckpt", self.entropy_checkpointing), ("compile", self.torch_compile),
                 ("gc", self.gradient_checkpointing), ("lora", self.lora),
                 ("sumpi2", self.sum_pi_squared), ("critic", self.critic),
                 ("tp", self.tensor_parallel > 1), ("pp", self.pipeline_parallel > 1),
                 ("vpp", self.virtual_pipeline), ("cp", self.context_parallel > 1),
                 ("ep", self.expert_parallel > 1), ("ropefusion", self.rope_fusion),
                 ("mtp", self.mtp_train))
        parts += [flag for flag, on in flags if on]
        parts += [self.loss_mode] if self.loss_mode != "vanilla" else []
        parts += [f"distill-{self.distillation}"] if self.distillation else []
        parts += [f"replay-{self.router_replay}"] if self.router_replay else []
        return ("sft-" if self.trainer == "sft" else "") + "-".join(parts)

    def verdict(self) -> tuple[str, tuple[str, ...], str]:
        """``(status, refusal keys, reason)`` of the trained model (the RL actor and reference,
        or the SFT trainer's model): status ``served`` or ``refused``."""
        from .unhooked import UNHOOKED

        if self.strategy in UNHOOKED:
            return "refused", ("verl.unhooked_engine",), UNHOOKED[self.strategy].setting
        if self.strategy not in {*FSDP_ENGINES.values(), *MEGATRON}:
            return "refused", ("cli.unpatched_engine",), (
                f"verl 0.9.1 registers no {self.strategy} engine")
        if self.strategy in MEGATRON:
            return self._megatron_verdict()
        keys = []
        if self.model_type in UNSERVED_VLM:
            keys.append("verl.multimodal")
        if self.ulysses > 1 and self.model_type in RECURRENT:
            keys.append("verl.ulysses.recurrent")
        if self.ulysses > 1 and self.vision:
            keys.append("verl.ulysses.vlm")
        keys += self._micro_batch_keys()
        if keys:
            return "refused", tuple(keys), ""
        return "served", (), ""

    def _micro_batch_keys(self) -> list[str]:
        """The switches verl's trainer sets on the batch that the engines refuse
        (``calculate_sum_pi_squared``, a top-k distillation loss)."""
        return (["verl.micro_batch_switch"]
                if self.sum_pi_squared or self.distillation in TOPK_DISTILLATION else [])

    def _megatron_verdict(self) -> tuple[str, tuple[str, ...], str]:
        """The sharing Megatron engine's refusals (``setup_problems`` of
        :mod:`.mcore_engine`): a vision tower, a Gated DeltaNet model on verl 0.9.1's
        megatron-core or LoRA (which make the rest moot), else fused kernels under context
        parallelism; then what the sharing layers refuse when the model is built, said at
        construction from the configs: a Mamba-2 hybrid's layers, DeepSeek sparse attention,
        MTP layers under routing replay, MLA with rope fusion; and per
        micro-batch a top-k distillation loss (:data:`TOPK_DISTILLATION`). Tensor, pipeline
        (interleaved too: verl overlaps its p2p), context and expert parallelism, rope fusion
        on GPT attention, recomputation, router replay and MTP training are served."""
        keys = [k for k, on in (("verl.megatron_vlm", self.vision),
                                ("verl.gdn_release", self.model_type in GDN),
                                ("verl.megatron_lora", self.lora)) if on]
        if not keys:
            keys = [k for k, on in (
                ("verl.fused_kernels", self.fused_kernels and self.context_parallel > 1),
                ("megatron.dsa", self.model_type in SPARSE_ATTENTION),
                # MTP is planned per depth, but not per replayed route
                ("megatron.mtp", self.mtp_train and bool(self.router_replay)),
                ("megatron.rope_fusion", self.rope_fusion and self.model_type in MLA),
                ("megatron.hybrid_layer", self.model_type in MAMBA_HYBRIDS)) if on]
            keys += self._micro_batch_keys()
        return ("refused", tuple(keys), "") if keys else ("served", (), "")

    def evidence(self) -> str:
        """The tests that show the verdict: an engine step against verl's stock step in
        :data:`TEST` for a served FSDP text combination (:data:`MEGATRON_TEST` for a served
        Megatron RL one, at TP=2); a served vision-language one runs per switch in the FSDP
        engine's VLM, fused-kernel, LoRA and FSDP1 tests (its verdict in :data:`TEST`)."""
        if (self.strategy in MEGATRON and self.trainer == "rl" and not self.vision
                and self.verdict()[0] == "served"):
            return f"engine step at TP=2: {MEGATRON_TEST}; verdict: {TEST}"
        if self.strategy in MEGATRON and self.distillation in TOPK_DISTILLATION:
            return f"verdict: {TEST}; refused per micro-batch: {MEGATRON_TEST}"
        if self.strategy not in FSDP_ENGINES.values():  # verdicts only (no engine step here)
            if self.strategy not in ENGINES_IN_VERL:
                return (f"verdict: {TEST}, preflight only (no such engine in verl 0.9.1)"
                        if self.trainer == "rl" else
                        "verdict: tests/verl_ext/test_recipes.py (no such engine in verl 0.9.1)")
            built = [k for k in self.verdict()[1] if k in MODEL_BUILD_KEYS]
            sft_step = self.trainer == "sft" and self.verdict()[0] == "served"
            return f"verdict: {TEST}" + (
                f" ({', '.join(built)} also raised building the model"
                + (": tests/megatron_ext/test_hybrid.py" if self.model_type in MAMBA_HYBRIDS
                   else " there") + ")" if built else "") + (
                f"; SFT step: {SFT_TESTS}" if sft_step else "")
        if self.trainer == "sft":
            switches = [name for name, on in (("FSDP1", self.strategy == "fsdp"),
                                              ("LoRA", self.lora), ("Ulysses", self.ulysses > 1),
                                              ("a vision tower", self.vision)) if on]
            if self.verdict()[0] != "served":
                return ""
            return f"SFT step: {SFT_TESTS}" + (
                f" ({', '.join(switches)}: tested on the RL step only)" if switches else "")
        if self.verdict()[0] != "served":
            return f"verdict: {TEST}"
        if self.vision:
            return f"verdict: {TEST}; steps per switch: {VLM_TESTS}"
        return f"engine step: {TEST}"

    def construction_keys(self) -> tuple[str, ...]:
        """The verdict's keys the engine raises when it is constructed (the others per
        micro-batch - ``calculate_sum_pi_squared`` rides on the batch -, :data:`BUILD_KEYS`)."""
        return tuple(k for k in self.verdict()[1] if k not in BUILD_KEYS)


def combinations(rows: Iterable[Row] | None = None) -> dict[Combination, list[Row]]:
    """Each distinct combination of the rows (every engine's) and the rows that map to it."""
    found: dict[Combination, list[Row]] = {}
    for row in all_rows(rows):
        found.setdefault(Combination.of(row), []).append(row)
    return dict(sorted(found.items()))


def _reason(key: str, combination: Combination) -> str:
    """The refusal's reason, the family's own for a refused vision-language family."""
    from ..refusals import REFUSALS
    from .vlm import UNSERVED_FAMILIES

    if key == "verl.multimodal" and combination.model_type in UNSERVED_FAMILIES:
        return UNSERVED_FAMILIES[combination.model_type]
    return REFUSALS[key].reason.replace("|", "\\|")


def render_section() -> list[str]:
    """docs/support.md's section: every combination, its launches, its verdict, its test."""
    lines = [
        "## verl 0.9 recipes",
        "",
        "verl 0.9's example launches (`docs/results/verl-0.9-recipes.csv`, one row per script "
        "under `examples/` of verl's `release/v0.9.0`: 107, every engine), reduced to the "
        "settings the sharing engines depend on (`prefix_sharing/verl_ext/recipes.py`; "
        "Ulysses sizes above 1 run at 2, Megatron's tensor, pipeline, context and expert "
        "sizes above 1 are read as 2, an unresolved `fsdp` is verl's default FSDP1, MindSpeed "
        "is verl's Megatron engine on Ascend). Status of the trained model (the RL actor and "
        "reference; the SFT trainer's model), verl 0.9.1: for every row (megatron-lite, which "
        "verl 0.9.1 has no engine for: its RL launch by preflight only, its SFT launch by the "
        "reduction) preflight of the recipe's overrides, on a tiny config "
        "of its family, and the construction of the engine verl selects give the keys shown "
        "(one process, one rank: the Megatron engine's construction reads the parallel sizes "
        "without megatron's parallel state; a served FSDP Ulysses engine is built at 2 ranks "
        "by the step test); what the Megatron engine's sharing layers refuse only when the model "
        "is built the engine says at construction, from the configs as verl's bridge maps "
        "them, and each Megatron row's tiny model is built from those fields and raises the "
        "same keys (a hybrid stack's in tests/megatron_ext/test_hybrid.py). A served FSDP "
        "text combination runs an engine step against verl's "
        "stock step with its switches (Ulysses at 2 ranks); a served vision-language one runs "
        "each switch in the tests named (the test module's docstring says what is merged and "
        "why); a served Megatron RL combination runs an engine step against verl's stock "
        "step at TP=2 with sequence parallelism, its other parallel sizes run per setting in "
        "the tests its module names (a Megatron SFT row: the tests shown). "
        "Engines prefix sharing does not hook (VeOmni, AutoModel, TorchTitan) are refused by "
        "name (`prefix_sharing/verl_ext/unhooked.py`).",
        "",
        "| combination | launches | status | keys, reason | tests |",
        "|---|---|---|---|---|",
    ]
    for combination, rows in combinations().items():
        status, keys, reason = combination.verdict()
        detail = "; ".join(f"`{k}`: " + _reason(k, combination) for k in keys) or reason
        if combination.critic:
            detail += ("; " if detail else "") + (
                "the critic: refused, `verl.critic.sequence_split` (Ulysses)"
                if combination.ulysses > 1 else "the critic: served (tests/verl_ext/test_critic.py)")
        lines.append(f"| {combination.name} | {len(rows)} | {status} | {detail} "
                     f"| {combination.evidence()} |")
    return lines
