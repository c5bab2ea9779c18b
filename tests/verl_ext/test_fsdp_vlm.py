"""verl's FSDP engine with prefix sharing on a vision-language checkpoint: still refused when
verl builds the engine, though the HF shim now serves these models (docs/huggingface.md): the
engine does not hand their images and mrope positions to the plan yet."""

import importlib.util

import pytest

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from tests.fsdp_compat._launch import run_gloo  # noqa: E402
from tests.verl_ext._compare import MODES  # noqa: E402
from tests.verl_ext._fsdp_engine import actor_config, build_engine, save_model  # noqa: E402


def one_rank(rank: int, path: str) -> str:
    from tests.verl_ext._batch import use_cpu_platform

    from prefix_sharing.errors import PrefixSharingSetupError

    use_cpu_platform()
    try:
        build_engine(actor_config(MODES["arbitrary_prefix"]), path)
    except PrefixSharingSetupError as error:
        return str(error)
    return "built"


def test_a_vision_language_checkpoint_is_refused_by_name(tmp_path):
    import transformers

    from prefix_sharing.fsdp_compat.vlm import MIN_TRANSFORMERS

    if tuple(int(p) for p in transformers.__version__.split(".")[:2]) < MIN_TRANSFORMERS:
        pytest.skip("the tiny VLM configs need transformers >= 5.10")
    path = save_model(str(tmp_path), "qwen2_5_vl")
    message = run_gloo(one_rank, 1, path, timeout=600)[0]
    assert message.startswith("prefix sharing refuses a multimodal model or inputs (the model "
                              "has a vision_config)"), message
    assert "[verl.multimodal]" in message
