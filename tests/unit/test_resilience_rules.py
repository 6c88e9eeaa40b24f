"""resilience.on_failure = "shrink": what the config accepts and refuses up front (one line naming the key), and
the fault-injection plan the ULFM tests read, and the mark a save carries so that a recovery writes it again."""
from __future__ import annotations

import pytest

from hpengine.config.load import ConfigError, load_config
from hpengine.run.launch import LaunchError
from hpengine.run.resilience import kill_plan, saving

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


def test_a_save_is_marked_for_the_recovery_while_it_runs_and_stays_marked_when_it_fails():
    class Guard:
        saving = -1

        def save_hook(self, step):
            return f"hook {step}"
    with saving(None, 3) as hook:          # no resilience: nothing to mark, no hook
        assert hook is None
    g = Guard()
    with saving(g, 3) as hook:
        assert (g.saving, hook) == (3, "hook 3")
    assert g.saving == -1
    with pytest.raises(OSError), saving(g, 6):
        raise OSError("a peer died")
    assert g.saving == 6                   # the recovery reads it: it writes the checkpoint of step 6 again
