"""Config: defaults, TOML files, --set overrides, strict keys and types, value checks, round trip."""
import dataclasses
import tomllib
from pathlib import Path

import pytest

from hpengine.config import load as C
from hpengine.config import reference as R
from hpengine.config.load import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOML = ROOT / "configs" / "default.toml"


def write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def leaf_keys(d, prefix=""):
    """Dotted names of every value in a nested dict."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from leaf_keys(v, f"{prefix}{k}.")
        else:
            yield prefix + k


def error(*args, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kw)
    msg = str(info.value)
    assert "\n" not in msg, "errors are one line"
    return msg


# ---- defaults and files --------------------------------------------------------------------------

def test_defaults():
    cfg = load_config(None)
    assert cfg == Config()
    m = cfg.model
    assert (m.kind, m.vocab_size, m.d_model, m.dtype) == ("gpt", 256, 256, "float32")
    assert (cfg.train.steps, cfg.train.global_batch, cfg.train.out_dir) == (300, 8, "runs/default")
    assert cfg.optim.betas == [0.9, 0.95] and cfg.optim.lr == 3e-3
    assert cfg.strategy.pipeline.split == "uniform" and cfg.strategy.sharding.stage == 1
    assert cfg.mesh.order == ["tp", "cp", "sharding", "dp", "pp"]
    assert C.enabled_strategies(cfg) == []
    # list defaults are not shared between instances
    Config().optim.betas.append(0.5)
    assert Config().optim.betas == [0.9, 0.95]


def test_every_field_has_a_doc():
    for path, cls in R._sections(Config, []):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{'.'.join(path)}.{f.name} has no doc"


def test_default_toml_loads_and_lists_every_strategy():
    cfg = load_config(DEFAULT_TOML)
    # the main job (make train, 4 ranks; any world size the batch divides): sharding stage 2 over every
    # rank, a global batch of 24 for 100 steps; every other key at its default
    want = Config()
    want.strategy.sharding.enable, want.strategy.sharding.degree, want.strategy.sharding.stage = True, -1, 2
    want.train.global_batch, want.train.steps = 24, 100
    assert cfg == want, "configs/default.toml spells out the defaults apart from the main job's switches"
    raw = tomllib.loads(DEFAULT_TOML.read_text())
    assert set(raw["strategy"]) == {f.name for f in dataclasses.fields(C.StrategyConfig)}
    assert {n for n, t in raw["strategy"].items() if t["enable"]} == {"sharding"}
    assert set(leaf_keys(raw)) == set(leaf_keys(C.to_dict(cfg))), "default.toml shows every key"


def test_partial_file_keeps_other_defaults(tmp_path):
    text = "[model]\nn_layers = 2\n[strategy.sharding]\nenable = true\nstage = 2\n"
    cfg = load_config(write(tmp_path, text))
    assert cfg.model.n_layers == 2 and cfg.model.d_model == 256
    assert cfg.strategy.sharding.stage == 2 and C.enabled_strategies(cfg) == ["sharding"]


def test_missing_file(tmp_path):
    msg = error(tmp_path / "nope.toml")
    assert "not found" in msg and "nope.toml" in msg


def test_toml_syntax_error_names_file_and_line(tmp_path):
    p = write(tmp_path, "[model]\nd_model = 64\nn_heads = = 4\n", name="broken.toml")
    msg = error(p)
    assert "broken.toml" in msg and "line 3" in msg


# ---- overrides -----------------------------------------------------------------------------------

def test_overrides_of_every_kind(tmp_path):
    cfg = load_config(None, [
        "optim.lr=1e-3",
        "strategy.sharding.enable=true",
        "mesh.order=['dp','tp','sharding','pp']",
        "data.path=foo.h5",
        "strategy.pipeline.split=[1, 3]",
        "train.out_dir = runs/x",
        "optim.betas=[0.8, 0.99]",
        "strategy.amp.init_scale=1024",      # int widened in a float field
        "train.steps=5",
    ])
    assert cfg.optim.lr == 1e-3
    assert cfg.strategy.sharding.enable is True
    assert cfg.mesh.order == ["dp", "tp", "sharding", "pp"]
    assert cfg.data.path == "foo.h5" and cfg.train.out_dir == "runs/x"
    assert cfg.strategy.pipeline.split == [1, 3]
    assert cfg.optim.betas == [0.8, 0.99]
    assert cfg.strategy.amp.init_scale == 1024.0 and isinstance(cfg.strategy.amp.init_scale, float)
    assert cfg.train.steps == 5


def test_override_wins_over_file_and_later_wins(tmp_path):
    p = write(tmp_path, "[optim]\nlr = 0.5\n")
    assert load_config(p).optim.lr == 0.5
    assert load_config(p, ["optim.lr=0.25"]).optim.lr == 0.25
    assert load_config(p, ["optim.lr=0.25", "optim.lr=0.125"]).optim.lr == 0.125


def test_string_override_of_non_string_text():
    cfg = load_config(None, ["train.out_dir=123", "data.path=", "runtime.backend='numpy'"])
    assert cfg.train.out_dir == "123" and cfg.data.path == "" and cfg.runtime.backend == "numpy"


@pytest.mark.parametrize("item, words", [
    ("optim.lr", ["optim.lr", "key=value"]),
    ("optim.lrr=1", ["optim.lrr", "lr", "betas", "clip_grad_norm"]),
    ("strategy.shardng.enable=true", ["strategy.shardng", "sharding", "pipeline"]),
    ("bogus=1", ["bogus", "model", "mesh"]),
    ("strategy.sharding=1", ["strategy.sharding", "section", "stage"]),
    ("optim.lr.x=1", ["optim.lr", "not a section"]),
])
def test_bad_override(item, words):
    msg = error(None, [item])
    for w in words:
        assert w in msg, (w, msg)


# ---- strict keys ---------------------------------------------------------------------------------

def test_unknown_key_in_file_names_key_and_valid_ones(tmp_path):
    msg = error(write(tmp_path, "[optim]\nlearning_rate = 0.1\n", name="job.toml"))
    assert "job.toml" in msg and "optim.learning_rate" in msg
    for key in ("lr", "betas", "eps", "weight_decay", "clip_grad_norm"):
        assert key in msg


def test_unknown_nested_key_and_section(tmp_path):
    msg = error(write(tmp_path, "[strategy.sharding]\nlevel = 2\n"))
    assert "strategy.sharding.level" in msg and "stage" in msg and "partition" in msg
    msg = error(write(tmp_path, "[strategy.zero]\nenable = true\n"))
    assert "strategy.zero" in msg and "data_parallel" in msg and "gradient_merge" in msg
    msg = error(write(tmp_path, "[modle]\nkind = 'gpt'\n"))
    assert "modle" in msg and "model" in msg


def test_section_given_a_value(tmp_path):
    msg = error(write(tmp_path, "model = 3\n"))
    assert "model" in msg and "table" in msg


def test_from_dict_is_strict():
    with pytest.raises(ConfigError, match=r"train\.stepz.*steps"):
        C.from_dict({"train": {"stepz": 3}})
    assert C.from_dict({"train": {"steps": 3}}).train.steps == 3


# ---- types ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("item, key, expected", [
    ("model.n_layers='3'", "model.n_layers", "int"),
    ("model.n_layers=3.0", "model.n_layers", "int"),
    ("model.n_layers=true", "model.n_layers", "int"),
    ("model.tie_head=1", "model.tie_head", "bool"),
    ("optim.lr=x", "optim.lr", "float"),
    ("optim.lr=false", "optim.lr", "float"),
    ("optim.betas=0.9", "optim.betas", "list of float"),
    ("optim.betas=[0.9, 'a']", "optim.betas", "list of float"),
    ("mesh.order=['tp', 1, 'dp', 'pp']", "mesh.order", "list of str"),
    ("strategy.pipeline.split=[1.5, 2]", "strategy.pipeline.split", "str or a list of int"),
])
def test_wrong_type(item, key, expected):
    msg = error(None, [item])
    assert msg.startswith(key + " = "), msg
    assert f"expected {expected}" in msg or f"expected a {expected}" in msg, msg


def test_wrong_type_in_file(tmp_path):
    msg = error(write(tmp_path, '[model]\nn_layers = "3"\n'))
    assert msg == 'model.n_layers = "3": expected int, got str'


def test_validate_widens_ints_in_float_fields():
    cfg = Config()
    cfg.optim.clip_grad_norm = 2
    cfg.optim.betas = [0, 0.5]
    C.validate(cfg)
    assert type(cfg.optim.clip_grad_norm) is float and all(type(b) is float for b in cfg.optim.betas)


# ---- values --------------------------------------------------------------------------------------

def test_negative_lr():
    assert error(None, ["optim.lr=-0.1"]) == "optim.lr = -0.1: must be >= 0"
    assert load_config(None, ["optim.lr=0"]).optim.lr == 0.0


@pytest.mark.parametrize("item, valid", [
    ("model.kind='gpt2'", ['"gpt"', '"mlp"']),
    ("model.dtype='float16'", ['"float32"', '"float64"']),
    ("optim.schedule='step'", ['"cosine"', '"linear"', '"constant"']),
    ("strategy.pipeline.schedule='gpipe'", ['"fthenb"', '"1f1b"', '"interleaved"']),
    ("strategy.sharding.stage=4", ["1", "2", "3"]),
    ("strategy.sharding.partition='rows'", ['"tensor"', '"flat"']),
    ("strategy.amp.dtype='float8'", ['"float16"', '"bfloat16"']),
    ("strategy.recompute.granularity='partial'", ['"full"', '"selective"']),
    ("runtime.backend='torch'", ['"auto"', '"numpy"', '"cupy"']),
])
def test_enum_lists_valid_choices(item, valid):
    msg = error(None, [item])
    assert msg.startswith(item.split("=")[0] + " = ") and "must be one of" in msg
    for v in valid:
        assert v in msg, (v, msg)


@pytest.mark.parametrize("item", [
    "model.vocab_size=0", "model.seq_len=-1", "model.n_layers=0", "model.ffn_mult=0",
    "train.steps=0", "train.global_batch=0", "train.eval_every=-1", "train.eval_batches=0",
    "train.log_every=0", "data.val_fraction=0", "data.val_fraction=1",
    "optim.betas=[0.9]", "optim.betas=[0.9, 0.95, 0.99]", "optim.betas=[0.9, 1.0]", "optim.betas=[-0.1, 0.9]",
    "optim.eps=0", "optim.weight_decay=-1", "optim.warmup_steps=-1", "optim.min_lr_ratio=1.5",
    "optim.clip_grad_norm=-1", "optim.lr=nan", "optim.lr=inf",
    "strategy.data_parallel.degree=0", "strategy.sharding.degree=-2", "strategy.pipeline.degree=0",
    "strategy.tensor_parallel.degree=-3", "strategy.data_parallel.bucket_mb=0",
    "strategy.pipeline.micro_batches=0", "strategy.pipeline.virtual_stages=0",
    "strategy.pipeline.split='even'", "strategy.pipeline.split=[2, 0]", "strategy.pipeline.split=[]",
    "strategy.recompute.every=0", "strategy.gradient_merge.k_steps=0",
    "strategy.amp.init_scale=0", "strategy.amp.growth_interval=0", "strategy.amp.backoff=1",
    "strategy.amp.backoff=0", "strategy.amp.growth_factor=1",
    "checkpoint.every=-1", "checkpoint.keep=0", "runtime.watchdog_s=-1",
])
def test_out_of_range_values_name_their_key(item):
    key = item.split("=")[0]
    assert error(None, [item]).startswith(key + " = ")


@pytest.mark.parametrize("item", [
    "train.eval_every=0", "checkpoint.every=0", "optim.clip_grad_norm=0", "optim.warmup_steps=0",
    "optim.min_lr_ratio=0", "optim.min_lr_ratio=1", "optim.betas=[0, 0.999]", "strategy.sharding.stage=3",
    "strategy.pipeline.degree=-1", "strategy.pipeline.degree=4", "strategy.pipeline.split='params'",
    "strategy.pipeline.split=[1, 2, 1]", "runtime.watchdog_s=30", "data.val_fraction=0.5",
])
def test_boundary_values_accepted(item):
    load_config(None, [item])


def test_d_model_divisible_by_n_heads():
    msg = error(None, ["model.d_model=100", "model.n_heads=3"])
    assert "model.d_model" in msg and "model.n_heads" in msg and "100" in msg and "3" in msg
    assert load_config(None, ["model.d_model=96", "model.n_heads=3"]).model.d_model == 96
    # heads mean nothing to the MLP, so its d_model is free
    mlp = load_config(None, ["model.kind='mlp'", "model.d_model=100", "model.n_heads=3"])
    assert mlp.model.d_model == 100


@pytest.mark.parametrize("order", ["['tp','dp','pp']", "['tp','dp','dp','pp']", "['tp','sharding','dp','ep']",
                                   "['tp','sharding','dp','pp','pp']"])
def test_mesh_order_must_be_a_permutation(order):
    msg = error(None, [f"mesh.order={order}"])
    assert msg.startswith("mesh.order = ") and "permutation" in msg


# ---- output and queries --------------------------------------------------------------------------

def test_to_toml_round_trip(tmp_path):
    cfg = load_config(None, [
        "strategy.pipeline.enable=true", "strategy.pipeline.split=[1, 3]", "strategy.pipeline.degree=2",
        "mesh.order=['pp','dp','sharding','tp']", "optim.lr=1e-05", "optim.clip_grad_norm=1",
        "data.path=dir with \"quotes\"\\and\ttab", "train.out_dir=runs/ünïcode", "model.dtype='float64'",
        "strategy.amp.init_scale=1e20",
    ])
    text = C.to_toml(cfg)
    assert "[strategy.pipeline]" in text and "split = [1, 3]" in text and "clip_grad_norm = 1.0" in text
    again = load_config(write(tmp_path, text))
    assert again == cfg
    assert type(again.optim.clip_grad_norm) is float and again.strategy.pipeline.split == [1, 3]
    assert C.to_dict(again) == C.to_dict(cfg)
    assert load_config(write(tmp_path, C.to_toml(Config()), "d.toml")) == Config()


def test_to_toml_escapes_control_characters(tmp_path):
    cfg = Config()
    cfg.data.path = "a\x01b\x7fc\nd"
    assert load_config(write(tmp_path, C.to_toml(cfg))).data.path == "a\x01b\x7fc\nd"


def test_to_dict_is_a_copy():
    cfg = Config()
    d = C.to_dict(cfg)
    d["mesh"]["order"].reverse()
    assert cfg.mesh.order == ["tp", "cp", "sharding", "dp", "pp"]
    assert C.from_dict(C.to_dict(cfg)) == cfg


def test_describe_mentions_every_key():
    text = R.describe()
    for path, cls in R._sections(Config, []):
        assert f"`[{'.'.join(path)}]`" in text or f"`[[{'.'.join(path)}]]`" in text
    sections = text.split("### ")[1:]
    by_name = {s.split("`")[1].strip("[]"): s for s in sections}
    for dotted in leaf_keys(C.to_dict(Config())):
        section, _, key = dotted.rpartition(".")
        assert f"| `{key}` |" in by_name[section], dotted
    assert '"interleaved"' in by_name["strategy.pipeline"]   # choices are listed
    assert "| `lr` | `0.003` |" in by_name["optim"]          # defaults are shown


def test_strategy_queries():
    from hpengine.layout.resolve import requested_degrees
    cfg = load_config(None, ["strategy.pipeline.enable=true", "strategy.pipeline.degree=2",
                             "strategy.amp.enable=true", "strategy.data_parallel.degree=4"])
    assert C.enabled_strategies(cfg) == ["pipeline", "amp"]
    assert requested_degrees(cfg) == {"tp": 1, "cp": 1, "sharding": 1, "dp": 1, "pp": 2}   # disabled: degree ignored
    cfg.strategy.data_parallel.enable = True
    assert requested_degrees(cfg)["dp"] == 4
    cfg.strategy.sharding.enable = True
    assert requested_degrees(cfg)["sharding"] == -1


def test_sources_config_round_trip(tmp_path):
    text = ('[data]\nval_path = "v.h5"\n\n[[data.sources]]\npath = "a.h5"\nweight = 2\n\n'
            '[[data.sources]]\npath = "b c.h5"\n')
    (tmp_path / "c.toml").write_text(text)
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.data.sources == [C.DataSource("a.h5", 2.0), C.DataSource("b c.h5", 1.0)]
    assert type(cfg.data.sources[0].weight) is float and cfg.data.val_path == "v.h5"
    out = C.to_toml(cfg)
    assert out.count("[[data.sources]]") == 2
    (tmp_path / "again.toml").write_text(out)
    assert load_config(tmp_path / "again.toml") == cfg
    assert C.from_dict(C.to_dict(cfg)) == cfg
    by_set = load_config(None, ['data.sources=[{path="a.h5", weight=2.0}, {path="b c.h5"}]', "data.val_path=v.h5"])
    assert by_set == cfg
    assert "### `[[data.sources]]`" in R.describe() and "| `weight` | `1.0` |" in R.describe()


@pytest.mark.parametrize("sets, message", [
    (['data.sources=[{path="a.h5"}, {path="b.h5", weight=-1}]'], "data.sources[1].weight = -1.0: must be > 0"),
    (['data.sources=[{path="a.h5", weight=0}]'], "data.sources[0].weight = 0.0: must be > 0"),
    (['data.sources=[{path=""}]'], 'data.sources[0].path = "": must name a token file'),
    (['data.sources=[{path="a.h5", weight="x"}]'], 'data.sources[0].weight = "x": expected float, got str'),
    (['data.sources="a.h5"'], 'data.sources = "a.h5": expected an array of tables [[data.sources]] with keys '
                              'path, weight'),
    (['data.sources=["a.h5"]'], 'data.sources[0] = "a.h5": expected a table with keys path, weight'),
    (['data.sources=[{path="a.h5", wieght=2}]'], "unknown key 'data.sources[0].wieght' (did you mean 'weight'?)"),
    (["data.path=x.h5", 'data.sources=[{path="a.h5"}]'], 'data.path = "x.h5" and data.sources (1 files) are both '
                                                         "set: set data.path for one file"),
])
def test_sources_config_errors(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
