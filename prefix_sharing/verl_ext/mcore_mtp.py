"""verl's MTP training (``model.mtp.enable_train``) in the sharing Megatron engine.

verl trains multi-token prediction through its own ``GPTModel._postprocess``
(``verl.models.mcore.mtp_patch``): the labels are each sample's ``input_ids`` rolled by one,
the loss mask is the prompt's zeros followed by the response mask, rolled by one as well, and
each depth rolls both once more along its sample (megatron's ``roll_tensor``). That is
megatron's MTP loss with megatron's loss-mask convention, which the sharing model scores per
depth (:mod:`prefix_sharing.megatron_ext.mtp`); what verl changes is the gradient rule:

- on megatron-core releases without ``process_mtp_loss`` (0.16: verl's legacy branch) the MTP
  loss does not train the output layer (verl detaches its parameters), later ones follow
  megatron's ``mtp_detach_heads``;
- ``mtp.detach_encoder``: the MTP loss trains neither the embedding nor the main decoder
  (verl detaches the first depth's input rows and every depth's embedding).

:func:`share_verl_mtp` gives the sharing model that rule after verl's ``patch_engine_mtp``;
:func:`mtp_plan_arguments` is what the shared forward plans per micro-batch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["mtp_plan_arguments", "mtp_problems", "share_verl_mtp", "trains_mtp",
           "verl_mtp_loss_masks"]


def trains_mtp(model_config: Any) -> bool:
    """Whether verl trains the model's MTP layers (``model.mtp.enable`` and ``enable_train``;
    a model config without an MTP section trains none)."""
    mtp = getattr(model_config, "mtp", None)
    return bool(getattr(mtp, "enable", False) and getattr(mtp, "enable_train", False))


def share_verl_mtp(chunks: list[torch.nn.Module], model_config: Any) -> None:
    """After verl's ``patch_engine_mtp`` on a sharing engine's model chunks: each chunk scores
    its MTP depths on their own layouts (:func:`~prefix_sharing.megatron_ext.mtp.
    share_multi_token_prediction`) with verl's gradient rule (module doc). verl's patched
    ``_postprocess`` stays the plain forward's (the self-check's reference); its
    ``detach_encoder`` patch of the MTP layers comes off (it rolls the flat rows along the
    packed layout), the sharing layer detaching the same tensors itself."""
    from megatron.core.transformer import multi_token_prediction

    from ..megatron_ext import share_multi_token_prediction

    detach_head = not hasattr(multi_token_prediction, "process_mtp_loss")
    detach_encoder = bool(getattr(model_config.mtp, "detach_encoder", False))
    for chunk in chunks:
        share_multi_token_prediction(chunk, detach_head=detach_head,
                                     detach_encoder=detach_encoder)
        for module in chunk.modules():
            if isinstance(module, multi_token_prediction.MultiTokenPredictionLayer):
                vars(module).pop("_get_embeddings", None)
                vars(module).pop("_get_embeddings_backup", None)


def mtp_plan_arguments(model: torch.nn.Module, mtp_enable_train: bool,
                       logits_processor_args: dict | None,
                       lengths: list[int]) -> dict[str, Any]:
    """``prepare_micro_batch``'s MTP keywords for a verl micro-batch of samples ``lengths``
    long: none for a model without MTP layers; the depths and verl's loss mask
    (:func:`verl_mtp_loss_masks`) when verl trains them; ``mtp_num_layers=0`` (the layers do
    not run, as in verl's forward without labels) otherwise."""
    from megatron.core.utils import unwrap_model

    depths = unwrap_model(model).config.mtp_num_layers
    if not depths:
        return {}
    if not mtp_enable_train:
        return {"mtp_num_layers": 0}
    args = logits_processor_args or {}
    return {"mtp_num_layers": depths,
            "loss_mask": verl_mtp_loss_masks(args["loss_mask"], lengths,
                                             args.get("response_attention_mask"))}


def verl_mtp_loss_masks(response_mask: torch.Tensor, lengths: list[int],
                        response_attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """verl's MTP loss mask per sample: zeros over the prompt, then the response mask (jagged
    nested, or right-padded with ``response_attention_mask`` giving each response's length),
    rolled by one along the sample as verl rolls its labels (position ``t`` weighs the
    prediction of token ``t + 1``; the last position takes the first's, a prompt zero)."""
    if response_mask.is_nested:
        responses = list(response_mask.unbind())
    else:
        if response_attention_mask is None:
            raise ValueError("a padded response mask needs verl's response_attention_mask")
        kept = response_attention_mask.sum(-1).tolist()
        responses = [row[:n] for row, n in zip(response_mask, kept)]
    if len(responses) != len(lengths):
        raise ValueError(f"{len(responses)} response masks for {len(lengths)} samples")
    masks = []
    for response, length in zip(responses, lengths):
        if response.numel() > length:
            raise ValueError(f"a response mask of {response.numel()} tokens for a sample of "
                             f"{length}")
        full = torch.cat([response.new_zeros(length - response.numel()), response])
        masks.append(torch.roll(full.float(), -1))
    return masks


def mtp_problems(model_config: Any, engine_config: Any, sharing: Any) -> list:
    """Where the Megatron engine does not train MTP layers with sharing on: a group run across
    micro-batches (:mod:`.cross_schedule` plans the decoder's rows only), and megatron's
    per-token loss, which verl normalises its own way (its legacy branch rescales by the rolled
    token count on every release, its ``process_mtp_loss`` branch by the routed tokens)."""
    from ..refusals import Refused

    if not trains_mtp(model_config):
        return []
    found = []
    if sharing.cross_micro_batch:
        found.append(Refused("verl.mtp", "model.mtp.enable_train=True with "
                                         "prefix_grouper.cross_micro_batch=true"))
    overrides = getattr(engine_config, "override_transformer_config", None) or {}
    if overrides.get("calculate_per_token_loss"):
        found.append(Refused("verl.mtp", "model.mtp.enable_train=True with "
                                         "override_transformer_config.calculate_per_token_loss"))
    return found
