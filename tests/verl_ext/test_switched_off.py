"""``ENABLE_PREFIX_SHARING`` as the prototype's runtime switch: one config, sharing on or off.

The config is the prototype's quick start (``use_prefix_grouper: true``, ``prefix_grouper:
{mode: arbitrary_prefix}``), run through verl's real Megatron engine (``_engine.run``: old
log-probs and entropy, ``ppo_loss`` and every gradient) in a spawned process that reads the
switch at ``import prefix_sharing``, next to the same run without the keys:

- at 0 it is that run bit for bit (verl's own engine class, no sharing metrics), and one log
  line says the environment switched sharing off;
- at 1 it shares (fewer tokens computed) and matches within fp32 tolerance.

Also the trainer's balancing hook at 0: verl's legacy trainer reads ``use_prefix_grouper`` to
order the batch; with the switch at 0 it orders it as without the key.
"""

import importlib.util
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if importlib.util.find_spec("verl") is None:
    pytest.skip("verl is not installed (build an environment with .ci/verl_env.sh <version>)",
                allow_module_level=True)

from prefix_sharing.engines.launch import run_distributed  # noqa: E402
from tests.verl_ext._compare import same_outputs  # noqa: E402

QUICK_START = {"mode": "arbitrary_prefix"}  # the prototype README's prefix_grouper block
WORKLOADS = ["grpo", "tree"]


def _job(rank: int) -> dict:
    """One rank: the config with and without the keys, and what got patched."""
    from tests.verl_ext._engine import run  # imports verl's engine (patched per the switch)

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("prefix_sharing.verl_ext.config").addHandler(handler)
    results = run(rank, WORKLOADS, {"without keys": None, "with keys": QUICK_START})

    from prefix_sharing.verl_ext import activation
    from prefix_sharing.verl_ext.engine import registered_engine
    from prefix_sharing.verl_ext.switched_off import TRAINER_MODULE

    return dict(results=results, enabled=activation.enabled(),
                log=[r.getMessage() for r in records],
                engine=registered_engine("language_model", "megatron").__name__,
                # the trainer is not imported here (verl 0.9.1's needs cachetools); its hook is
                # among those the finder waits for
                balancing_hooked=TRAINER_MODULE in activation._targets())


def _switched(value: str) -> dict:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ENABLE_PREFIX_SHARING", value)  # the spawned process inherits it
        env.delenv("PREFIX_SHARING_PATCHSET", raising=False)
        (got,) = run_distributed(_job, 1, timeout=400)
    return got


def test_0_runs_verls_stock_computation_bit_for_bit():
    got = _switched("0")
    assert (got["enabled"], got["engine"], got["balancing_hooked"]) == (
        False, "MegatronEngineWithLMHead", True)
    assert got["log"] == [
        "prefix-sharing: switched off by ENABLE_PREFIX_SHARING=0: McoreActorConfig asks for it "
        "(use_prefix_grouper / prefix_grouper); verl runs its stock computation"]
    for workload in WORKLOADS:
        with_keys, without = (got["results"][workload, k] for k in ("with keys", "without keys"))
        assert with_keys["train"]["metrics"] == without["train"]["metrics"]
        assert with_keys["train"]["loss"] == without["train"]["loss"]
        for key, tensors in without["infer"]["model_output"].items():
            assert all(torch.equal(a, b) for a, b in
                       zip(with_keys["infer"]["model_output"][key], tensors, strict=True)), key
        assert with_keys["grads"].keys() == without["grads"].keys()
        assert all(torch.equal(with_keys["grads"][n], g) for n, g in without["grads"].items())


def test_1_shares_with_the_same_config():
    got = _switched("1")
    # at 1 the trainer is hooked too: by the sharing-aware balancing (verl_ext.balancing)
    assert (got["enabled"], got["engine"], got["balancing_hooked"], got["log"]) == (
        True, "PrefixSharingMegatronEngine", True, [])
    for workload in WORKLOADS:
        with_keys, without = (got["results"][workload, k] for k in ("with keys", "without keys"))
        metrics = with_keys["train"]["metrics"]
        computed, total = (metrics[f"prefix_sharing/tokens_{k}"][0] for k in ("computed", "total"))
        assert computed < total, f"{workload}: nothing shared"
        same_outputs(with_keys, without, f"ENABLE_PREFIX_SHARING=1 {workload}")


def test_the_trainers_balancing_at_0_is_its_balancing_without_the_key():
    """Two uid groups of unequal lengths on 2 data-parallel ranks: verl's grouping (key on)
    orders them differently from its length balancing (key absent); at 0 it is the latter."""
    from verl import DataProto
    try:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    except ModuleNotFoundError as missing:  # verl 0.9.1's trainer imports cachetools, which
        pytest.skip(f"verl's trainer does not import here: {missing}")  # its wheel omits

    import inspect

    from prefix_sharing.verl_ext.switched_off import stock_balancing

    lengths = [9, 3, 7, 5, 8, 2, 6, 4]
    mask = torch.tensor([[1] * n + [0] * (10 - n) for n in lengths])

    def order(trainer_class, use_prefix_grouper: bool) -> list[int]:
        batch = DataProto.from_dict(tensors={"attention_mask": mask, "index": torch.arange(8)},
                                    non_tensors={"uid": np.array(list("aaaabbbb"), dtype=object)})
        trainer = SimpleNamespace(use_prefix_grouper=use_prefix_grouper,
                                  actor_rollout_wg=None, _get_dp_size=lambda wg, role: 2)
        trainer_class._balance_batch(trainer, batch, {})
        return batch.batch["index"].tolist()

    # this process shares: verl's function is under the sharing-aware balancing's wrapper
    stock = type("Stock", (RayPPOTrainer,),
                 {"_balance_batch": inspect.unwrap(RayPPOTrainer._balance_batch)})
    switched_off = type("Trainer", (stock,), {})
    stock_balancing(SimpleNamespace(RayPPOTrainer=switched_off))
    assert stock._balance_batch is not switched_off._balance_batch
    without_key = order(stock, False)
    assert order(stock, True) != without_key  # the key matters to stock verl
    assert order(switched_off, True) == without_key
