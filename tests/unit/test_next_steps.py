"""The last line of `hpengine train` names the run folder and commands that work on it as printed."""
from hpengine.config import load_config
from hpengine.run.train import next_steps


def _cfg(tmp_path, *sets):
    return load_config(None, [f"train.out_dir={tmp_path / 'run x'}", *sets])


def _save(root):
    (root / "step_00000003").mkdir(parents=True)
    (root / "latest").write_text("step_00000003")


def test_finished_run_names_its_folder_and_the_next_commands(tmp_path):
    cfg = _cfg(tmp_path)
    _save(tmp_path / "run x" / "checkpoints")
    line = next_steps(cfg, tmp_path / "run x")
    q = f"'{tmp_path / 'run x'}'"                       # quoted for the shell: a folder name with a space
    assert line == (f"run folder {q}; next: hpengine generate {q} --prompt 'def ' ; "
                    f"hpengine eval {q} --data TOKENS.h5 ; hpengine plot {q}")


def test_several_models_a_validation_file_and_a_checkpoint_dir_elsewhere(tmp_path):
    cfg = _cfg(tmp_path, "train.models=2", f"checkpoint.dir={tmp_path / 'ck'}", "data.val_path=val.h5")
    _save(tmp_path / "ck")
    line = next_steps(cfg, tmp_path / "run x")
    assert f"hpengine generate {tmp_path / 'ck'} --model 0 --prompt" in line
    assert f"hpengine eval {tmp_path / 'ck'} --data val.h5 ;" in line


def test_stopped_early_says_how_to_continue_and_no_checkpoint_says_so(tmp_path):
    cfg = _cfg(tmp_path)
    assert next_steps(cfg, tmp_path / "run x").endswith(f"(no checkpoint saved); next: hpengine plot "
                                                        f"'{tmp_path / 'run x'}'")
    line = next_steps(cfg, tmp_path / "run x", "SIGINT")      # Ctrl-C before the first save: auto starts over
    assert line.endswith(f"(stopped early by SIGINT, no checkpoint yet: it starts over in this folder); "
                         f"continue with: hpengine train '{tmp_path / 'run x'}'/config.toml --resume auto")
    _save(tmp_path / "run x" / "checkpoints")
    line = next_steps(cfg, tmp_path / "run x", "SIGTERM")
    assert line.endswith(f"(stopped early by SIGTERM); continue with: hpengine train "
                         f"'{tmp_path / 'run x'}'/config.toml --resume auto")
