"""verl's SFT step as its trainer drives a worker's engine, for the SFT tests (one engine, FSDP
or Megatron, per run): the trainer's batch of conversations sharing a system prompt plus a turn
chain (:func:`sft_batch`), its ``engine`` section through verl's conversion with the sharing
keys in it (:func:`sft_engine_config`, :func:`fsdp_sft_config`), its loss (:func:`sft_loss`),
and one step's outputs (:func:`fsdp_sft_step`: the log-probs of every position as validation
asks, the loss and every gradient).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

SYSTEM = 40  # the shared system prompt's tokens


def sft_batch(seed: int = 0, vocab_size: int = 512):
    """A batch as verl's SFT trainer hands it to its worker: ``SFTTensorCollator`` (no padding)
    over 4 conversations opening with one system prompt (user / assistant turns of their own,
    the assistant's tokens in ``loss_mask``) and 2 turn-level samples of a fifth (the shorter
    a strict prefix of the longer), then the trainer's ``meta_info`` (micro-batches of 2)."""
    import torch
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import SFTTensorCollator

    rng = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(3, vocab_size, (n,), generator=rng)

    system = tokens(SYSTEM)

    def conversation(turns):
        ids, mask = [system], [torch.zeros(SYSTEM, dtype=torch.long)]
        for user, assistant in turns:
            ids += [tokens(user), tokens(assistant)]
            mask += [torch.zeros(user, dtype=torch.long), torch.ones(assistant, dtype=torch.long)]
        return torch.cat(ids), torch.cat(mask)

    samples = [conversation([(6 + i, 5 + i), (4, 3 + i)]) for i in range(4)]
    chain = conversation([(7, 5), (5, 6)])
    first_turn = SYSTEM + 7 + 5
    samples += [(chain[0][:first_turn], chain[1][:first_turn]), chain]
    data = SFTTensorCollator("no_padding")(
        [{"input_ids": ids, "loss_mask": mask, "position_ids": torch.arange(len(ids))}
         for ids, mask in samples])
    meta_info = {"use_remove_padding": True, "use_dynamic_bsz": False,
                 "max_token_len_per_gpu": 8192, "micro_batch_size_per_gpu": 2,
                 "temperature": 1.0, "global_batch_size": len(samples),
                 "pad_mode": "no_padding", "pad_token_id": 0}
    batch = tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta_info)
    tu.assign_non_tensor(batch, use_fused_kernels=False)
    return batch


def sft_engine_config(target: str, prefix_grouper: dict | None, **fields):
    """The SFT trainer's ``engine`` section through verl's conversion, with the sharing keys
    in it when ``prefix_grouper`` is given; what verl's worker then sets from the model and
    data sections."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    section = dict(_target_=target, **fields)
    if prefix_grouper is not None:
        section.update(use_prefix_grouper=True, prefix_grouper=prefix_grouper)
    config = omega_conf_to_dataclass(OmegaConf.create(section))
    config.use_remove_padding = True
    config.use_dynamic_bsz = False
    config.micro_batch_size_per_gpu = 2
    return config


def sft_loss():
    """verl's SFT loss as its trainer binds it."""
    from verl.workers.utils.losses import sft_loss

    return partial(sft_loss, config=None)


def step_output(infer, train, grads) -> dict:
    from ._batch import plain_output

    return {"infer": plain_output(infer), "train": plain_output(train), "grads": grads}


def fsdp_sft_config(prefix_grouper: dict | None, **engine: Any) -> SimpleNamespace:
    """What verl's SFT worker builds its FSDP2 engine from: the ``engine`` section (fp32;
    ``engine``: more of its keys, e.g. ``ulysses_sequence_parallel_size``) with the sharing
    keys when ``prefix_grouper`` is given, and the optimizer and checkpoint sections."""
    from ._fsdp_engine import FP32, actor_config

    stock = actor_config(None)  # its optimizer and checkpoint sections
    engine_config = sft_engine_config("verl.workers.config.FSDPEngineConfig", prefix_grouper,
                                      strategy="fsdp2", mixed_precision=FP32,
                                      use_torch_compile=False, **engine)
    return SimpleNamespace(strategy="fsdp2", engine=engine_config, optim=stock.optim,
                           checkpoint=stock.checkpoint)


def fsdp_sft_step(engine) -> dict:
    """One SFT step on the FSDP ``engine``: the log-probs of every position (``infer_batch`` in
    eval mode, as the trainer's validation calls it), then ``forward_backward_batch`` with
    ``sft_loss`` and every gradient gathered whole (in train mode, which zeroes them on exit)."""
    from prefix_sharing.fsdp_compat.fsdp import full_gradients

    with engine.eval_mode():
        infer = engine.infer_batch(sft_batch(), loss_function=sft_loss())
    with engine.train_mode():
        train = engine.forward_backward_batch(sft_batch(), sft_loss())
        return step_output(infer, train, full_gradients(engine.module))


