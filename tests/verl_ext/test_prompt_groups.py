"""``prompt_only`` finds each sample's prompt and uid in what verl's trainers hand the engines
(``prefix_sharing.verl_ext.mcore.micro_batch_groups``, used by the Megatron and FSDP engines
alike): the legacy trainer's padded layout (verl 0.8.0, 0.9's ``use_v1: false``) and the v1
trainer's per-sample TransferQueue fields (verl 0.9.1's default, which failed before), in the
micro-batches and mini-batches verl's own splitters cut."""

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.verl_ext._batch import make_batch, use_cpu_platform  # noqa: E402

LAYOUTS = ["legacy"] + (["v1"] if importlib.util.find_spec("transfer_queue") else [])




@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sizes", [dict(num_prompts=3, group_size=4),
                                   dict(num_prompts=4, group_size=2)])
def test_each_micro_batch_gets_its_uid_groups_and_their_prompt_lengths(layout, sizes):
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    from prefix_sharing.planner import prompt_groups
    from prefix_sharing.verl_ext.mcore import micro_batch_groups, prompt_lengths

    use_cpu_platform()  # verl 0.8.0's unpadding imports flash_attn otherwise
    reference = make_batch("grpo", layout="legacy", **sizes)  # padded masks: the plain truth
    data = make_batch("grpo", layout=layout, **sizes)
    lengths = prompt_lengths(reference)
    assert prompt_lengths(data) == lengths
    uids = tu.get(reference, "uid")
    assert len(set(uids)) > 1 and len(set(lengths)) > 1
    whole = micro_batch_groups(data, len(uids))
    assert whole == prompt_groups(uids, lengths)
    micro_batches, _ = prepare_micro_batches(data)  # verl's fixed-size micro-batches
    mini_batches = list(tu.make_iterator(data, mini_batch_size=2, epochs=1))
    for split in (micro_batches, mini_batches):
        offset = 0
        for mb in split:
            size = mb["input_ids"].size(0)
            assert micro_batch_groups(mb, size) == prompt_groups(
                uids[offset: offset + size], lengths[offset: offset + size])
            offset += size
        assert offset == len(uids)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prompt_only_without_uid_raises_one_error_naming_the_setting(layout):
    from prefix_sharing.verl_ext.mcore import PrefixSharingSetupError, micro_batch_groups

    use_cpu_platform()
    data = make_batch("grpo", layout=layout)
    del data["uid"]
    with pytest.raises(PrefixSharingSetupError, match=r"prompt_only mode without uids \("
                                                      "prefix_grouper.mode=prompt_only"):
        micro_batch_groups(data, data["input_ids"].size(0))


def test_a_batch_without_any_prompt_length_raises_naming_the_setting():
    from prefix_sharing.verl_ext.mcore import PrefixSharingSetupError, prompt_lengths

    use_cpu_platform()
    data = make_batch("grpo", layout=LAYOUTS[-1])
    for key in ("prompts", "attention_mask"):
        del data[key]
    with pytest.raises(PrefixSharingSetupError, match=r"without prompt lengths \("
                                                      r"prefix_grouper.mode=prompt_only\)"):

        prompt_lengths(data)
