"""The table behind :mod:`.refusals`: every refusal's key, setting, reason and engines.

Kept as data (no imports but the dataclass) so that the table, the support matrix and the docs
page generated from both can be read without megatron-core, verl or a kernel installed. Add an
entry here and raise it with :func:`prefix_sharing.refusals.refuse`; ``tests/test_refusals.py``
fails on a raise that bypasses the table, on a key no site uses, and on a stale
``docs/support.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ENGINES", "TABLE", "Refusal"]

# Where a refusal applies: the integration (or the command) whose path runs the check.
ENGINES = ("megatron-core", "megatron-lm", "verl-megatron", "verl-fsdp", "hf-fsdp", "ascend",
           "kernels", "cli")
_MEGATRON = ("megatron-core", "megatron-lm", "verl-megatron", "ascend")
_VERL = ("verl-megatron", "verl-fsdp")


@dataclass(frozen=True)
class Refusal:
    """One refused setting: ``key`` (stable, dotted), ``setting`` (a short noun phrase),
    ``reason`` (why sharing cannot give the plain results with it, and what to use instead),
    ``engines`` (from :data:`ENGINES`)."""

    key: str
    setting: str
    reason: str
    engines: tuple[str, ...]


TABLE: tuple[Refusal, ...] = (
    # --- megatron-core: the model's settings (checks.py, core attention, model check) -------
    Refusal("megatron.dsa", "DeepSeek sparse attention",
            "DSA picks each query's top-k keys with an indexer over the whole packed sequence, "
            "which a shared prefix's keys would have to be restricted for; use the dense "
            "attention", _MEGATRON),
    Refusal("megatron.mtp", "multi-token prediction not planned per depth",
            "each MTP depth is planned on its own (a depth-k row is shared only where the next "
            "k tokens agree too), on the last pipeline stage, a layer per depth; replay "
            "would need each depth's routes, and a per-token loss under CP each rank's roll; "
            "share the MTP block (with_prefix_sharing or "
            "share_multi_token_prediction(model), prepare_micro_batch(mtp_num_layers=...)), or "
            "leave those settings at their defaults", _MEGATRON),
    Refusal("megatron.mrope", "multimodal RoPE",
            "the plan carries one position per computed token, and multimodal RoPE takes three "
            "rows per token (temporal, height, width), which the Megatron path does not carry "
            "yet; the HF / FSDP shim serves Qwen VLMs (docs/huggingface.md)", _MEGATRON),
    Refusal("megatron.window_reads_later_keys", "a sliding window that reads later keys",
            "a causal sliding window reads no later keys; keep the left size and set the right "
            "one to 0", _MEGATRON),
    Refusal("megatron.virtual_pipeline.two_stage_p2p",
            "interleaved pipeline stages at PP=2 without overlapped p2p",
            "at pipeline_model_parallel_size=2 megatron's interleaved schedule exchanges the next "
            "activation and the next gradient with a stage's one neighbour in one call, their "
            "shapes matched in the order posted; with a planned micro-batch's own flat length "
            "a stage received another micro-batch's gradient as its activation (over gloo); set "
            "overlap_p2p_comm=True and batch_p2p_comm=False, as verl and Megatron-LM do under "
            "virtual pipeline stages", ("megatron-core", "verl-megatron", "ascend")),
    Refusal("megatron.rope_fusion", "MLA's fused RoPE",
            "MLA's fused RoPE kernels (fused_apply_mla_rope_for_q / _kv) take positions from "
            "cu_seqlens, restarting in every segment, and no per-token table, but a reuser's "
            "tail starts at its prefix length (GPT attention keeps TE's fused RoPE, given one "
            "rotary row per token); set apply_rope_fusion=False", _MEGATRON),
    Refusal("megatron.context_parallel.moe_per_token_loss",
            "per-token loss with MoE under context parallelism",
            "the router's z-loss is weighted per token as at CP=1 for megatron's per-micro-batch "
            "loss only; use calculate_per_token_loss=False", _MEGATRON),
    Refusal("megatron.hidden_dropout", "hidden dropout in training",
            "every reuser would get its provider's dropout mask on the shared prefix; set "
            "hidden_dropout=0", _MEGATRON),
    Refusal("megatron.attention_dropout", "attention dropout in training",
            "the varlen kernels here run without dropout; set attention_dropout=0", _MEGATRON),
    Refusal("megatron.attention_bias", "an attention_bias",
            "the prefix-sharing core attention takes no additive bias over the plan's rows; "
            "build the model without one", _MEGATRON),
    Refusal("megatron.te_fp8", "FP8 attention with the Transformer Engine kernel",
            "not validated by prefix sharing; choose backend='flash_attn', or train without fp8",
            _MEGATRON),
    Refusal("megatron.inference_context", "an inference context (KV cache)",
            "prefix sharing is for training and scoring forwards; run generation without a "
            "sharing plan", _MEGATRON),
    Refusal("megatron.plan_mismatch", "ranks or stages with different sharing plans",
            "stages exchange only activations, so a stage that planned another micro-batch would "
            "mix layouts; every stage and tensor-parallel rank must plan the same sequences with "
            "the same config", _MEGATRON),
    Refusal("megatron.stock_core_attention", "an attention layer without the sharing core "
            "attention", "the layer needs PrefixSharingCoreAttention to read the plan; build "
            "the spec with prefix_sharing.megatron_ext.with_prefix_sharing", _MEGATRON),
    Refusal("megatron.stock_modules", "stock modules on a sharing forward",
            "they would read the flat layout as the plain batch; build the model from a layer "
            "spec made by prefix_sharing.megatron_ext.with_prefix_sharing", _MEGATRON),
    Refusal("megatron.context_parallel.unplanned_input",
            "context parallelism on an input without a plan",
            "the prefix-sharing attention splits only micro-batches from prepare_micro_batch "
            "(the plan's rows); use context_parallel_size=1 for other inputs", _MEGATRON),
    # --- megatron-core: MoE ---------------------------------------------------------------
    Refusal("megatron.moe.capacity_factor", "MoE token dropping by capacity",
            "which tokens an expert drops depends on the other tokens of the batch; use dropless "
            "MoE (moe_expert_capacity_factor=None)", _MEGATRON),
    Refusal("megatron.moe.rank_capacity_factor", "a per-rank MoE token budget",
            "which tokens an expert rank drops depends on the other tokens of the batch; use "
            "moe_expert_rank_capacity_factor=None", _MEGATRON),
    Refusal("megatron.moe.sinkhorn", "Sinkhorn routing",
            "Sinkhorn routing normalizes over the batch's tokens, and a shared prefix counts "
            "once; use another moe_router_load_balancing_type", _MEGATRON),
    Refusal("megatron.moe.quantile_balancing", "quantile load balancing",
            "its routing thresholds are quantiles over the computed tokens of the batch (and it "
            "refuses a padding mask), so a shared prefix would count once instead of once per "
            "reader", _MEGATRON),
    Refusal("megatron.moe.input_jitter", "router input jitter in training",
            "every reuser would get its provider's router noise on the shared prefix; set "
            "moe_input_jitter_eps=None", _MEGATRON),
    Refusal("megatron.moe.forced_routing", "the benchmark's forced router logits",
            "the random router logits are drawn per computed token, so every reuser would get "
            "its provider's draw; route with the model's router", _MEGATRON),
    Refusal("megatron.moe.replay_router_fusion", "routing replay with the fused router",
            "the fused top-k ignores the replayed routes; set moe_router_fusion=False",
            _MEGATRON),
    Refusal("megatron.moe.padding_mask", "a padding_mask with a sharing plan (within or "
            "across micro-batches)",
            "the plan already says which rows are padding; drop the padding_mask", _MEGATRON),
    Refusal("megatron.moe.recompute", "MoE recompute with router statistics",
            "the recomputed router would run outside the layer that knows the sharing plan; use "
            "recompute_granularity='full' or drop 'moe' from recompute_modules", _MEGATRON),
    Refusal("megatron.moe.record_context_parallel",
            "recording routes under context parallelism",
            "not supported with sharing yet: record at context_parallel_size=1", _MEGATRON),
    Refusal("megatron.moe.record_with_statistics",
            "recording routes in a forward that keeps router statistics",
            "record in a forward without grad (no aux loss, z-loss or expert bias update), as "
            "verl's compute_log_prob does", _MEGATRON),
    # --- megatron-core: routing replay ----------------------------------------------------
    Refusal("megatron.routing_replay.off", "routes with routing replay off",
            "routes to replay came with the micro-batch but the model does not replay; set "
            "moe_enable_routing_replay=True (or drop the routes)", _MEGATRON),
    Refusal("megatron.routing_replay.record_unplanned", "recording routes without a plan that "
            "records", "recorded routes would be the flat rows'; plan with "
            "prepare_micro_batch(record_routes=True) and read them with recorded_routes, or "
            "record with a forward that does not share (no plan)", _MEGATRON),
    Refusal("megatron.routing_replay.record_action", "a recording plan without the record "
            "action", "set RouterReplayAction.RECORD for the recording forward", _MEGATRON),
    Refusal("megatron.routing_replay.no_routes", "replay without routes on the micro-batch",
            "megatron's replay targets are laid out per input token, which the flat layout is "
            "not; pass the routes to prepare_micro_batch(routes=...)", _MEGATRON),
    Refusal("megatron.routing_replay.nothing_recorded", "a recording forward that recorded "
            "nothing", "set RouterReplayAction.RECORD and plan with record_routes=True",
            _MEGATRON),
    Refusal("megatron.routing_replay.layer_index", "routing replay outside GPTModel layers",
            "the layer holding the router does not say which MoE layer it is, so it cannot pick "
            "its column of the routes; replay in GPTModel layers", _MEGATRON),
    Refusal("megatron.routing_replay.routes_shape", "replayed routes of another model",
            "the routes' layers and top-k must be this model's (verl's R2: its MoE layers, R3: "
            "every layer)", _MEGATRON),
    # --- megatron-core: layer specs -------------------------------------------------------
    Refusal("megatron.spec.form", "a spec with_prefix_sharing does not recognise",
            "give a TransformerLayer ModuleSpec, a TransformerBlockSubmodules with a list of "
            "layer specs, or a list of layer specs", _MEGATRON),
    Refusal("megatron.spec.layer", "a layer that is not a TransformerLayer ModuleSpec",
            "with_prefix_sharing swaps submodules of megatron's TransformerLayer specs only",
            _MEGATRON),
    Refusal("megatron.spec.attention", "a self_attention other than SelfAttention or "
            "MLASelfAttention", "with_prefix_sharing replaces the core attention of those two "
            "ModuleSpecs only", _MEGATRON),
    Refusal("megatron.spec.gdn_mixer", "a Gated DeltaNet slot that is not megatron's "
            "GatedDeltaNet", "only megatron's GatedDeltaNet ModuleSpec is replaced by the "
            "prefix-sharing one", _MEGATRON),
    Refusal("megatron.spec.router", "an MoE router other than megatron's TopKRouter",
            "only megatron's TopKRouter is replaced by the prefix-sharing router", _MEGATRON),
    Refusal("megatron.spec.mlp_form", "an mlp spec whose module cannot be told",
            "it must be a ModuleSpec, a functools.partial of a class or classmethod, or a "
            "class, so that with_prefix_sharing can tell whether its router must be swapped",
            _MEGATRON),
    Refusal("megatron.spec.moe_layer_class", "MoE in a layer class other than TransformerLayer",
            "with_prefix_sharing hands the plan to the router from its own TransformerLayer "
            "subclass; use megatron's TransformerLayer", _MEGATRON),
    # --- megatron-core: hybrids and releases ----------------------------------------------
    Refusal("megatron.gdn_release", "Gated DeltaNet layers on this megatron-core",
            "prefix sharing carries its state with megatron-core 0.19.2's GatedDeltaNet "
            "(megatron.core.ssm.gated_delta_net); 0.16.1 and 0.17.1 have no packed path and "
            "0.18.2's module differs: install megatron-core==0.19.2 (Python >= 3.12)",
            (*_MEGATRON, "cli")),
    Refusal("megatron.gdn.context_parallel", "Gated DeltaNet layers under context parallelism",
            "megatron's GDN all-to-all would split the flat layout's segments; use "
            "context_parallel_size=1", (*_MEGATRON, "cli")),
    Refusal("megatron.hybrid_layer", "a hybrid layer with no sharing version (Mamba: 'M')",
            "megatron's Mamba mixer runs mamba_ssm's CUDA kernels, which no CPU test runs: its "
            "sharing version (the SSD state at each branch point) is not built; patterns of "
            "'*', 'G' (Gated DeltaNet, megatron-core 0.19.2), '-' and 'E' run", _MEGATRON),
    # --- the command's megatron engine ----------------------------------------------------
    Refusal("cli.mamba_preset", "a Mamba-2 preset on the megatron engine",
            "megatron-core's MambaMixer trains through mamba_ssm's fused "
            "mamba_split_conv1d_scan_combined with packed sequences kept apart by seq_idx, each "
            "starting from a zero state and with no initial-state input (the kernel takes one "
            "initial state per batch row), so a reuser's tail cannot start from its provider's "
            "state at the branch point; and its kernels are CUDA-only: use --engine hf",
            ("cli",)),
    Refusal("cli.unpatched_engine", "sharing on a verl engine prefix sharing does not patch",
            "prefix sharing runs in verl's FSDP (strategy fsdp, fsdp2) and Megatron (megatron) "
            "language-model engines; on another engine (VeOmni, TorchTitan, AutoModel, ...) "
            "use_prefix_grouper changes nothing: set actor_rollout_ref.actor.strategy=fsdp2 "
            "or megatron", ("cli",)),
    Refusal("cli.vlm_preset", "a vision-language preset on the megatron engine",
            "the megatron engine builds a GPT of the preset's text shape, with no vision tower to "
            "encode the images its bench puts into the prompts: use --engine hf", ("cli",)),
    Refusal("cli.vlm_preset_sequences", "a vision-language preset with --sequences",
            "a rollout file holds token ids (and at most image hashes), not the pixel tensors "
            "the vision tower encodes; the built-in workloads get synthetic images: use "
            "--workload, or analyze for a dump's vision tokens", ("cli",)),
    Refusal("cli.gdn_key_heads", "a tensor-parallel size that does not divide the Gated "
            "DeltaNet key heads", "megatron splits the GDN heads over the tensor-parallel ranks; "
            "choose a tp that divides them", ("cli",)),
    Refusal("cli.reference_context_parallel", "a reference layout under context parallelism",
            "only the 'shared' layout splits a micro-batch across context-parallel ranks; the "
            "references run at context_parallel_size=1", ("cli",)),
    # --- Megatron-LM ----------------------------------------------------------------------
    Refusal("megatron_lm.spec", "a --spec other than the sharing one",
            "the sharing entry point builds its model with its own layer spec", ("megatron-lm",)),
    Refusal("megatron_lm.transformer_impl", "a --transformer-impl other than "
            "transformer_engine or local", "the sharing spec is built from megatron-core's "
            "transformer_engine or local layer spec; use one of them", ("megatron-lm",)),
    Refusal("megatron_lm.model_argument", "a Megatron-LM argument that builds another model",
            "it builds another core attention, per-layer specs, or ModelOpt's or Kitchen's "
            "spec, which the sharing spec is not; leave it unset", ("megatron-lm",)),
    Refusal("megatron_lm.attention_backend_local", "--attention-backend local",
            "it replaces the sharing core attention with megatron's DotProductAttention; use "
            "--attention-backend auto", ("megatron-lm",)),
    Refusal("megatron_lm.moe_layer_freq", "MoE on only some layers",
            "the sharing --spec is one layer spec for every layer, so MoE needs an MoE layer "
            "everywhere (--moe-layer-freq 1)", ("megatron-lm",)),
    Refusal("megatron_lm.builder_option", "a Megatron-LM option this megatron-core's spec "
            "builder lacks", "the sharing spec is built by megatron-core's builder, which has no "
            "option to build it with; unset it or install the megatron-core that has it",
            ("megatron-lm",)),
    Refusal("megatron_lm.context_parallel", "context parallelism in Megatron-LM's loop",
            "the sharing entry point runs with context parallel size 1", ("megatron-lm",)),
    Refusal("megatron_lm.virtual_pipeline", "virtual pipeline stages in Megatron-LM's loop",
            "interleaved stages are not supported by the sharing entry point "
            "(--num-layers-per-virtual-pipeline-stage)", ("megatron-lm",)),
    Refusal("megatron_lm.combined_1f1b", "--overlap-moe-expert-parallel-comm",
            "its combined-1F1B schedule plan runs the layers without the sharing forward step",
            ("megatron-lm",)),
    Refusal("megatron_lm.micro_batch_size", "a --micro-batch-size other than 1 with rollouts",
            "with --prefix-sharing-data each micro-batch is one pack of group-kept sequences; "
            "use --micro-batch-size 1 and --prefix-sharing-token-budget to size it",
            ("megatron-lm",)),
    # --- Ascend / MindSpeed ---------------------------------------------------------------
    Refusal("ascend.reset_attention_mask", "--reset-attention-mask under MindSpeed",
            "MindSpeed's GPTModel.forward wrapper replaces packed_seq_params with its own "
            "end-of-document segments, dropping the plan", ("ascend",)),
    Refusal("ascend.tp_2d", "--tp-2d under MindSpeed",
            "MindSpeed replaces SelfAttention.__init__ and the rotary class", ("ascend",)),
    Refusal("ascend.alibi", "ALiBi under MindSpeed (--position-embedding-type alibi)",
            "MindSpeed replaces DotProductAttention", ("ascend",)),
    Refusal("ascend.context_parallel_algo", "a MindSpeed context-parallel algorithm that "
            "bypasses the plan", "use --context-parallel-algo megatron_cp_algo, whose layers run "
            "the prefix-sharing attention's own CP communication", ("ascend",)),
    Refusal("ascend.import_order", "the sharing attention defined on MindSpeed's CP class",
            "prefix_sharing.megatron_ext was first imported after MindSpeed's context-parallel "
            "patch; call prefix_sharing.npu.enable_mindspeed(), or import "
            "prefix_sharing.megatron_ext, before MindSpeed is patched for context parallelism",
            ("ascend",)),
    Refusal("ascend.fused_attention", "a sharing plan in MindSpeed's fused attention",
            "MindSpeed's fused attention cannot inject shared prefixes; build the model with a "
            "prefix-sharing layer spec (prefix_sharing.megatron_ext.with_prefix_sharing)",
            ("ascend",)),
    # --- verl -----------------------------------------------------------------------------
    Refusal("verl.dynamic_context_parallel", "dynamic context parallelism",
            "verl builds it on megatron's dynamic DPxCP groups "
            "(initialize_model_parallel(dynamic_context_parallel=...)), which no megatron-core "
            "release up to 0.19.2 has (verl 0.8.0 and 0.9.1 assert it; 0.19.2 has only "
            "hybrid_context_parallel), so sharing under it cannot run or be tested; use a static "
            "context_parallel_size", ("verl-megatron",)),
    Refusal("verl.ulysses.recurrent", "Ulysses sequence parallelism on a model with "
            "recurrent layers",
            "a Gated DeltaNet or Mamba-2 layer's recurrence over the plan's segments would need "
            "its state passed between the Ulysses ranks, which the sharing recurrence does not "
            "do (verl runs Qwen3.5's GDN under Ulysses only through FLA's CUDA context-parallel "
            "kernels, Qwen3-Next's and Nemotron-H's not at all); keep "
            "ulysses_sequence_parallel_size=1 (for long sequences use the Megatron engine's "
            "context_parallel_size)", ("verl-fsdp",)),
    Refusal("verl.ulysses.vlm", "Ulysses sequence parallelism on a vision-language model",
            "verl slices a VLM's sequence after the embedding, inside the text model, which the "
            "shim's mrope rows and image features of the flat layout do not follow yet; keep "
            "ulysses_sequence_parallel_size=1", ("verl-fsdp",)),
    Refusal("verl.fused_kernels",
            "fused log-probs under context parallelism or across micro-batches (Megatron engine)",
            "the sharing engine serves use_fused_kernels with its own head, run in chunks from "
            "the hidden states of the whole flat layout on each tensor-parallel rank; under "
            "context parallelism each rank holds a slice of the rows, and the cross-micro-batch "
            "forward scores from logits; set actor_rollout_ref.model.use_fused_kernels=false",
            ("verl-megatron",)),
    Refusal("verl.micro_batch_switch", "a micro-batch switch that needs per-sample logits",
            "calculate_sum_pi_squared, distillation and (Megatron engine) fused kernels need "
            "per-sample labels or logits, which the flat layout does not have; turn the switch "
            "off", _VERL),
    Refusal("verl.mtp", "MTP training outside one micro-batch of the Megatron engine",
            "the Megatron engine plans each MTP depth of a micro-batch with verl's loss mask; "
            "the FSDP engines train no MTP layers, a group run across micro-batches plans "
            "the decoder's rows only, and verl normalises a per-token MTP loss its own way; set "
            "model.mtp.enable_train=False, prefix_grouper.cross_micro_batch=false or "
            "calculate_per_token_loss=false", _VERL),
    Refusal("verl.model_type", "a model other than a language or value model",
            "sharing covers verl's language models (the actor, the reference) and value models "
            "(the critic): model_type 'language_model' or 'value_model'", _VERL),
    Refusal("verl.critic.sequence_split", "a sharing critic with its sequences split over ranks",
            "a value is read from the flat row that computed its token, which under Ulysses or "
            "context parallelism may lie on another rank (the actor's split gathers log-probs, "
            "not values): set critic.ulysses_sequence_parallel_size=1 / "
            "critic.megatron.context_parallel_size=1, or critic.use_prefix_grouper=false", _VERL),
    Refusal("verl.self_check.value_model", "the first-step self-check on the critic",
            "it compares log-probs, which a value model does not return; set "
            "critic.prefix_grouper.self_check=false (tests compare the critic with verl's "
            "stock value engine)", _VERL),
    Refusal("verl.unhooked_engine", "sharing on a verl engine prefix sharing does not hook "
            "(VeOmni, AutoModel, TorchTitan)",
            "the engine builds and parallelizes the model itself (its own attention dispatch, "
            "sequence parallelism and kernels), which prefix sharing does not hook: the run "
            "would compute every shared prefix. Use model_engine=fsdp / engine=fsdp (strategy "
            "fsdp2) or megatron for sharing, or use_prefix_grouper=false", ("verl-fsdp",)),
    Refusal("verl.multimodal", "a multimodal model or inputs",
            "verl's Megatron engine is text-only here; verl's FSDP engine serves Qwen2.5-VL, "
            "Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 dense and MoE (images and text-only "
            "micro-batches) and refuses the other families by name: GLM-4.1V (its vision tower "
            "and positions are not in the HF shim), MiniCPM-o (transformers ships no model "
            "class) (docs/verl.md)", _VERL),
    Refusal("verl.megatron_vlm", "a vision-language model on verl's Megatron engine",
            "verl builds its Megatron model through Megatron-Bridge, whose import needs "
            "Transformer Engine (megatron/bridge/peft/lora_layers.py), or mbridge 0.15.1, whose "
            "Qwen2.5-VL needs Transformer Engine layers and packed attention in its vision "
            "tower, fails on megatron-core 0.16.1 (Qwen2_5VLSelfAttention.forward takes no "
            "rotary_pos_cos_sin) and does not pack verl's THD micro-batch; so verl's own "
            "Megatron VLM step, the reference, has not run, and the Megatron plan carries no "
            "mrope rows: use verl's FSDP engine (strategy: fsdp2), which serves Qwen2.5-VL and "
            "Qwen3-VL images (docs/verl.md)", ("verl-megatron",)),
    Refusal("verl.megatron_lora", "LoRA on verl's Megatron engine",
            "verl trains Megatron LoRA only through Megatron-Bridge's PEFT, whose import needs "
            "Transformer Engine (megatron/bridge/peft/lora_layers.py), so verl's own Megatron "
            "LoRA step, the reference, has not run; use verl's FSDP engine (strategy: fsdp2, "
            "model.lora_rank), which serves LoRA (docs/verl.md), or set model.lora.rank=0",
            ("verl-megatron",)),
    Refusal("verl.prompt_lengths", "prompt_only mode without prompt lengths",
            "the batch has neither nested prompts (verl's v1 trainer) nor the padded "
            "attention_mask with prompts or response_mask (its legacy trainer); use "
            "mode=arbitrary_prefix, which reads only the token ids", _VERL),
    Refusal("verl.prompt_uids", "prompt_only mode without uids",
            "prompt groups are the samples with the same uid; use mode=arbitrary_prefix, which "
            "reads only the token ids", _VERL),
    Refusal("verl.temperatures", "several sampling temperatures in one micro-batch",
            "a shared row serves several samples, so they need one temperature", _VERL),
    Refusal("verl.self_check.layout", "the first-step self-check with pipeline, context "
            "parallelism or routing replay", "its stock run would not be verl's stock path on "
            "the same micro-batch; set self_check: false", ("verl-megatron",)),
    Refusal("verl.self_check.recurrent", "the first-step self-check on a recurrent model",
            "it compares with verl's stock path, which has no exact packed form for a model "
            "with recurrent layers (Gated DeltaNet, Mamba-2); set self_check: false",
            ("verl-fsdp",)),
    Refusal("verl.self_check.vlm", "the first-step self-check on a vision-language model",
            "it compares with verl's stock packed path, whose Qwen2.5-VL attention calls "
            "flash-attention's varlen kernel directly; set self_check: false (tests compare "
            "with verl's padded step)", ("verl-fsdp",)),
    Refusal("verl.gdn_release", "a Gated DeltaNet hybrid in verl's Megatron engine on this "
            "megatron-core", "sharing carries the Gated DeltaNet state with megatron-core "
            "0.19.2's GatedDeltaNet only: install megatron-core==0.19.2, or use verl's FSDP "
            "engine (strategy: fsdp2), which serves these models on any release, or turn "
            "sharing off (use_prefix_grouper: false)",

            ("verl-megatron",)),
    Refusal("verl.routing_replay.r2_context_parallel", "R2 routing replay under context "
            "parallelism", "recording routes under context parallelism is not supported with "
            "sharing yet; R3 is", ("verl-megatron",)),
    Refusal("verl.routing_replay.padded_statistics", "routing replay with router statistics "
            "on a padded batch", "verl's replay patch drops megatron's padding mask, and the "
            "router's slice of the plain batch is padded (context_parallel_size > 1, tensor "
            "parallelism or a per-sequence aux loss); turn the router statistics off or use "
            "context_parallel_size=1, tensor parallel size 1", ("verl-megatron",)),
    Refusal("verl.routing_replay.r3_without_routes", "R3 routing replay without the rollout's "
            "routes", "the micro-batch has no routed_experts; record them in the rollout",
            ("verl-megatron",)),
    Refusal("verl.cross_micro_batch.recurrent", "a recurrent model's groups across micro-batches",
            "a Gated DeltaNet or Mamba-2 layer carries its state along the tokens, and a shared "
            "block hands its readers only its keys and values; set cross_micro_batch: false "
            "(the group is split, each piece computing its prefix)", _VERL),
    Refusal("verl.cpu_shim_release", "a verl release the CPU test shim does not know",
            "prefix_sharing.testing.verl_cpu patches the releases that have patch sets "
            "(prefix_sharing.releases.VERL_RELEASES) only", _VERL),

    Refusal("verl.cpu_rollout_wire_format", "a weight wire format other than full tensors in "
            "the CPU test rollout", "the hf CPU rollout loads full weights "
            "(wire_format='named_tensors'), not a delta engine's (such as delta_sharded); use a "
            "checkpoint engine that sends full tensors", _VERL),
    # --- HuggingFace / FSDP2 --------------------------------------------------------------

    Refusal("hf.alibi", "ALiBi position biases", "prefix sharing covers rotary-position "
            "decoders only", ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.multimodal", "a multimodal model", "prefix sharing covers text-only causal LMs "
            "(token-id sequences) and the vision-language families qwen2_5_vl, qwen3_vl, "
            "qwen3_vl_moe, qwen3_5, qwen3_5_moe", ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.vlm_release", "a vision-language model on transformers older than 5.10",
            "4.x's get_rope_index reads the placeholders itself and its configs file mrope under "
            "rope_scaling (tested on 5.10 and 5.24): pip install -U transformers, or train the "
            "text model", ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.video", "video inputs", "prefix sharing covers a vision-language model's images "
            "only (pixel_values, image_grid_thw), not video (pixel_values_videos, "
            "video_grid_thw, video placeholder tokens)", ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.images_for_text_model", "images for a text-only model",
            "images are shared for the vision-language families only (qwen2_5_vl, qwen3_vl, "
            "qwen3_vl_moe, qwen3_5, qwen3_5_moe); pass multi_modal_inputs=None", ("hf-fsdp",)),
    Refusal("hf.stock_vision_features", "a stock image-feature model left in a VLM",
            "its get_image_features would place each distinct image once, not at every "
            "placeholder row of the flat layout: call enable_prefix_sharing(model) after the "
            "model is complete", ("hf-fsdp",)),
    Refusal("hf.softcapping", "attention logit soft-capping", "the sharing kernels do not "
            "soft-cap: set the config's attn_logit_softcapping to None", ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.bidirectional", "bidirectional attention", "prefix sharing needs causal "
            "attention", ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.attention_interface", "a model outside transformers' AttentionInterface",
            "the sharing attention is installed through AttentionInterface; the model's "
            "attention does not route through it", ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.residual_dropout", "residual (layer-output) dropout",
            "a shared prefix row is one row, so its reusers would share one dropout mask where "
            "the plain batch draws one per sequence; set the config's residual_dropout to 0 "
            "(verl: override_config)", ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.attention_dropout", "attention dropout",
            "the sharing attention has no attention dropout; set the config's "
            "attention_dropout to 0", ("hf-fsdp", "verl-fsdp")),

    Refusal("hf.stock_recurrent_module", "a stock recurrent module left in the model",
            "it would carry one sequence's state into the next on the flat layout: call "
            "enable_prefix_sharing(model) after the model is complete", ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.mtp", "multi-token-prediction modules in a hybrid model",
            "prefix sharing does not train MTP layers (RL recipes turn them off): drop them",
            ("hf-fsdp", "verl-fsdp")),
    Refusal("hf.recurrent_family", "a recurrent model family sharing does not serve",
            "its layers carry a state across tokens; prefix sharing serves the Gated DeltaNet "
            "hybrids and the Mamba-2 hybrid nemotron_h only (not mamba, mamba2, bamba, jamba, "
            "zamba2, falcon_h1, granitemoehybrid)", ("hf-fsdp", "verl-fsdp")),
    # --- attention kernels ----------------------------------------------------------------
    Refusal("kernels.sinks", "attention sinks with a fused kernel",
            "the kernel has no sink term in its softmax (gpt-oss sinks, megatron softmax_type "
            "'learnable' / 'off-by-one'); choose backend='torch'", ("kernels",)),
    Refusal("kernels.lse", "the log-sum-exp from a kernel that does not return it here",
            "varlen_attention(return_lse=True) runs on the backends with a with-lse pair "
            "(LSE_KERNELS in prefix_sharing/attention/backends.py); choose backend='torch'",
            ("kernels",)),
    Refusal("kernels.dtype", "a dtype the kernel does not compute in",
            "flash-attn and Transformer Engine's THD attention compute in float16 and bfloat16 "
            "only; choose backend='torch' for float32", ("kernels",)),
    Refusal("kernels.head_dim", "a head dim the kernel does not take",
            "choose backend='torch' (or another kernel)", ("kernels",)),
    Refusal("kernels.value_head_dim", "a value head dim larger than the query/key head dim",
            "flash-attn 2 takes one head dim; choose backend='te' or 'torch'", ("kernels",)),
    Refusal("kernels.te_release", "a Transformer Engine release without arbitrary THD segments",
            "transformer-engine < 2.2 runs padding_causal_bottom_right THD attention only for "
            "segment lengths that are multiples of 64; install transformer-engine >= 2.2 (with "
            "cuDNN >= 9.7), or choose backend='flash_attn' or 'torch'", ("kernels",)),
    Refusal("kernels.npu_heads", "a head layout npu_fusion_attention (TND) does not take",
            "it takes 1 to 256 query heads, a multiple of the key/value heads; choose "
            "backend='torch'", ("kernels", "ascend")),
)
