"""The offline LLM takes the component configs' fields as keyword arguments."""

import dataclasses

import pytest

from dspark_serve.drafter.config import DrafterConfig
from dspark_serve.scheduler.config import SchedulerConfig
from dspark_serve.scheduler.llm import OFFLINE_DEFAULTS, offline_configs
from dspark_serve.verifier.config import ModelConfig


def test_every_config_field_is_a_keyword_and_lands_in_its_config():
    model, drafter, sched = offline_configs()
    assert model.device == "cpu" and sched.max_waiting == OFFLINE_DEFAULTS["max_waiting"]
    assert drafter == DrafterConfig()
    assert dataclasses.replace(model, device=ModelConfig().device) == ModelConfig()
    for cfg, cls in ((model, ModelConfig), (drafter, DrafterConfig), (sched, SchedulerConfig)):
        for f in dataclasses.fields(cls):
            value = getattr(cfg, f.name)
            # a value different from the default, valid for the field, must reach the config
            new = {bool: lambda v: not v, int: lambda v: v * 2 if v else 4, float: lambda v: v / 2}.get(
                type(value)
            )
            if new is None:
                continue
            out = offline_configs(**{f.name: new(value)})
            got = getattr(out[(ModelConfig, DrafterConfig, SchedulerConfig).index(cls)], f.name)
            assert got == new(value), f.name


def test_unknown_keywords_and_bad_values_are_refused():
    with pytest.raises(TypeError, match="max_num_seq"):
        offline_configs(max_num_seq=3)
    with pytest.raises(ValueError, match="magic"):
        offline_configs(drafter="magic")


def test_auto_names_the_load_aware_policy_only_with_a_drafter():
    from dspark_serve.scheduler.policy import DSparkPolicy, parse_policy

    assert SchedulerConfig().policy_spec(drafting=True) == "dspark"
    assert SchedulerConfig().policy_spec(drafting=False) == "none"
    assert SchedulerConfig(verify_policy="static:3").policy_spec(drafting=True) == "static:3"
    assert isinstance(parse_policy(SchedulerConfig().policy_spec(True)), DSparkPolicy)
