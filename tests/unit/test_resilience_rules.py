"""resilience.on_failure = "shrink": what the config accepts and refuses up front (one line naming the key), and
the fault-injection plan the ULFM tests read."""
from __future__ import annotations

import pytest

from hpengine.config.load import ConfigError, load_config
from hpengine.run.launch import LaunchError
from hpengine.run.resilience import kill_plan

SHRINK = ["resilience.on_failure='shrink'", "checkpoint.async=false"]


def test_shrink_is_accepted_under_data_parallel_and_sharding_with_adamw():
    load_config(None, [*SHRINK, "strategy.data_parallel.enable=true"])
    load_config(None, [*SHRINK, "strategy.sharding.enable=true", "strategy.sharding.stage=3"])


@pytest.mark.parametrize("keys,named", [
    (["strategy.diloco.enable=true", "checkpoint.async=false"], "strategy.diloco.enable = false"),
    (["strategy.sharding.enable=true", "optim.name='muon'"], "optim.name = 'adamw' under sharding (got 'muon')"),
    (["checkpoint.async=true"], "checkpoint.async = false"),
])
def test_what_shrink_cannot_carry_is_refused_in_one_line(keys, named):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["resilience.on_failure='shrink'", *keys])
    assert named in str(e.value) and "\n" not in str(e.value)


def test_kill_plan_reads_step_save_eval_wait_and_end_kills():
    assert kill_plan({"HPENGINE_FAULT_KILL": "1@3, 4@save:5"}) == {1: (3, "step"), 4: (5, "save")}
    assert kill_plan({"HPENGINE_FAULT_KILL": "2@eval:3,5@wait,3@end"}) == {2: (3, "eval"), 5: (0, "wait"),
                                                                            3: (0, "end")}
    assert kill_plan({}) == {}
    for bad in ("1@later:3", "1@wait:2", "1@eval"):
        with pytest.raises(LaunchError, match="WORLD_RANK@save:STEP"):
            kill_plan({"HPENGINE_FAULT_KILL": bad})
