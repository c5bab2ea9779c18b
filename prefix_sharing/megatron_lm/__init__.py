"""Megatron-LM's own training loop with prefix sharing (a thin adapter on ``megatron_ext``).

    python -m prefix_sharing.megatron_lm sft <Megatron-LM arguments> --data-path convs.jsonl
    python -m prefix_sharing.megatron_lm gpt <Megatron-LM arguments> --prefix-sharing-data r.jsonl

runs Megatron-LM's ``pretrain()`` with the sharing layer spec and a forward step that plans
every micro-batch on every pipeline stage (:mod:`.forward_step`). Needs megatron-core >= 0.17
(its wheel ships ``megatron.training``); nothing is imported until it runs.
"""
