"""The llama model kind's config keys: the width rule, the keys of one kind refused on another, and every
bad input one line naming the key and what is valid, exit status 2 on every rank before any collective."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpengine.config import load as C
from hpengine.cli.commands import main
from hpengine.config.load import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LLAMA = ["model.kind=llama", "model.d_model=64", "model.n_heads=8"]


@pytest.mark.parametrize("d,multiple,want", [(256, 256, 768), (4096, 256, 11008), (4096, 1, 10922), (96, 64, 256)])
def test_llama_width_rule(d, multiple, want):
    # Llama: hidden = int(2/3 x 4 d), rounded up to a multiple (LLaMA-7B: d 4096 -> 11008)
    cfg = load_config(None, ["model.kind=llama", f"model.d_model={d}", "model.n_heads=8",
                             f"model.ffn_multiple_of={multiple}"])
    assert C.ffn_width(cfg.model) == want
    assert C.ffn_width(load_config(None, [*LLAMA, "model.ffn_hidden=100"]).model) == 100


@pytest.mark.parametrize("extra,words", [
    (["model.n_kv_heads=3"], ["model.n_heads = 8", "model.n_kv_heads = 3", "must divide"]),
    (["model.n_kv_heads=16"], ["model.n_kv_heads = 16", "must divide"]),
    (["model.n_heads=16", "model.d_model=48"], ["48 / 16 = 3 is odd", "even"]),
    (["model.d_model=60"], ["model.d_model = 60", "model.n_heads = 8", "model.head_dim"]),
    (["model.head_dim=5"], ["model.head_dim = 5 is odd", "even"]),
    (["model.head_dim=-2"], ["model.head_dim = -2", "must be >= 0"]),
    (["model.ffn_multiple_of=0"], ["model.ffn_multiple_of = 0", "must be >= 1"]),
    (["model.ffn_hidden=-4"], ["model.ffn_hidden = -4", "must be >= 0"]),
    (["model.rope_theta=0"], ["model.rope_theta = 0.0", "must be > 0"]),
    (["model.norm_eps=-1e-6"], ["model.norm_eps", "must be > 0"]),
    (["model.ffn_mult=4"], ["model.ffn_mult applies to model.kind = 'gpt' or 'mlp', not 'llama'"]),
])
def test_llama_bad_input_is_one_line(extra, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*LLAMA, *extra])
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_head_dim_frees_the_width_from_the_heads():
    """With model.head_dim set, d_model need not be a multiple of n_heads (Qwen3: 128-wide heads at any width)."""
    m = load_config(None, [*LLAMA, "model.d_model=60", "model.head_dim=16"]).model
    assert (C.head_width(m), C.head_width(load_config(None, LLAMA).model)) == (16, 8)


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
@pytest.mark.parametrize("key", ["n_kv_heads=2", "ffn_hidden=64", "ffn_multiple_of=64", "rope_theta=5e5",
                                 "norm_eps=1e-6", "head_dim=8"])
def test_llama_keys_are_refused_on_other_kinds(kind, key):
    with pytest.raises(ConfigError, match=f"model.{key.split('=')[0]} applies to model.kind = 'llama'( or 'deepseek')?, "
                                        f"not '{kind}'"):
        load_config(None, [f"model.kind={kind}", f"model.{key}"])


def test_a_key_of_another_kind_in_a_file_is_refused_even_at_its_default(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nkind = "llama"\nn_heads = 8\nffn_mult = 4\n')
    with pytest.raises(ConfigError, match="model.ffn_mult applies to"):
        load_config(path)


def test_resolved_llama_config_round_trips_without_other_kinds_keys(tmp_path):
    cfg = load_config(None, [*LLAMA, "model.n_kv_heads=2", "model.rope_theta=500000"])
    text = C.to_toml(cfg)
    assert "n_kv_heads = 2" in text and "ffn_mult =" not in text
    (tmp_path / "r.toml").write_text(text)
    assert load_config(tmp_path / "r.toml") == cfg
    assert "n_kv_heads" not in C.to_toml(load_config(None))


def test_kv_heads_not_divisible_by_tp_names_the_numbers(capsys):
    rc = main(["config", str(ROOT / "configs" / "llama_small.toml"), "--world", "4",
               "--set", "strategy.tensor_parallel.enable=true", "--set", "strategy.tensor_parallel.degree=4"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "tensor_parallel.degree = 4 must divide" in err and "n_kv_heads = 2" in err


def test_bad_llama_input_exits_2_on_every_rank_with_one_line_per_job(tmp_path):
    exe = BIN / "mpiexec"
    if not exe.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "MPI_LOCAL"))}
    res = subprocess.run([str(exe), "-n", "2", str(BIN / "hpengine"), "train", str(ROOT / "configs" / "llama_small.toml"),
                          "--set", "model.n_kv_heads=3", "--set", f"train.out_dir={tmp_path / 'run'}"],
                         capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, cwd=tmp_path, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr      # every rank has the same error: the job says it once
    assert "model.n_kv_heads = 3" in lines[0]
    assert not (tmp_path / "run").exists()


def test_an_unknown_kind_is_named_before_its_keys():
    with pytest.raises(ConfigError, match='model.kind = "bert": must be one of "gpt", "llama", "deepseek", "mlp"'):
        load_config(None, ["model.kind=bert", "model.ffn_mult=4", "model.n_kv_heads=2"])
