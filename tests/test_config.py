"""Configuration parsing and validation: pure, no MPI."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbs_mpi.tools import config
from dbs_mpi.tools.cli import parse_train_args
from dbs_mpi.tools.config import Config, ConfigError, UserError


def test_defaults_are_valid_and_round_trip():
    c = Config()
    assert config.from_dict(json.loads(c.to_json())) == c


def test_toml_then_command_line(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('strategy = "static"\nglobal_batch = 128\nspeeds = [1, 0.5]\n[model_section]\nlr = 0.1\n')
    c = parse_train_args(["--config", str(f), "--global-batch", "64", "--speeds", "1,0.25"])
    assert (c.strategy, c.global_batch, c.speeds, c.lr) == ("static", 64, (1.0, 0.25), 0.1)


def test_a_checkpoints_configuration_from_an_older_version_still_loads():
    """Older versions accepted the parameter server's options under a synchronous strategy
    and ignored them: a checkpoint's configuration has them at their defaults (nothing
    they did changes), so the run resumes; an asynchronous run keeps them."""
    old = json.loads(Config().to_json())
    old.update(time_budget=600.0, softsync_n=4, staleness_lr=True)
    with pytest.raises(ConfigError, match="^softsync_n: "):
        config.from_dict(old)
    resumed = config.from_dict(config.stored(old))
    assert (resumed.time_budget, resumed.softsync_n, resumed.staleness_lr) == (0.0, 1, False)
    assert config.from_dict(config.stored({**old, "strategy": "nsoftsync"})).time_budget == 600.0


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    f = tmp_path / "run.toml"
    f.write_bytes(b'strategy = "st\xe4tic"\n')
    with pytest.raises(ConfigError, match=r"^config: cannot read .*run\.toml"):
        parse_train_args(["--config", str(f)])


@pytest.mark.parametrize("argv, field", [
    (["--global-batch", "0"], "global_batch"),
    (["--global-batch", "-3"], "global_batch"),
    (["--global-batch", "1.5"], "global_batch"),
    (["--speeds", "1,0"], "speeds"),
    (["--speeds", "1,-0.5"], "speeds"),
    (["--speeds", "1,fast"], "speeds"),
    (["--speeds", "1e6,1e-300"], "speeds"),   # 1e306x slower: would never finish
    (["--slow-factor", "1e9"], "slow_factor"),
    (["--couple", "0"], "couple"),
    (["--couple", "0:fast"], "couple"),
    (["--couple=-1:2"], "couple"),
    (["--couple", "0:0.5"], "couple"),        # K < 1 would be faster beside others
    (["--couple", "0:2,0:3"], "couple"),
    (["--couple", "1:2", "--strategy", "asgd"], "couple"),
    (["--strategy", "fastest"], "strategy"),
    (["--epochs", "0"], "epochs"),
    (["--lr", "nan"], "lr"),
    (["--progress", "maybe"], "progress"),
    (["--dbs-smoothing", "0"], "dbs_smoothing"),
    (["--synthetic-shape", "3,32"], "synthetic_shape"),
    (["--sync-bn", "--strategy", "asgd"], "sync_bn"),
    (["--sync-bn", "sometimes"], "sync_bn"),
    (["--compile", "--sync-bn", "--micro-batch", "8"], "micro_batch"),     # compiled or not: SyncBatchNorm's batch
    (["--compile", "--strategy", "asgd"], "compile"),
    (["--amp", "fp8"], "amp"),
    (["--micro-batch", "-1"], "micro_batch"),
    (["--micro-batch", "8", "--sync-bn"], "micro_batch"),
    (["--micro-batch", "8", "--strategy", "asgd"], "micro_batch"),
    (["--amp", "bf16", "--strategy", "nsoftsync"], "amp"),
    (["--compile", "--compile-backend", "fastest"], "compile_backend"),
    (["--lr-schedule", "cosine", "--strategy", "asgd"], "lr_schedule"),
    (["--warmup-epochs", "1", "--strategy", "dbs-sgd"], "lr_schedule"),
    (["--sample-dropout", "--strategy", "asgd"], "sample_dropout"),
    (["--calibration-from", "run.h5", "--strategy", "ssgd"], "calibration_from"),
    (["--seed", "-5"], "seed"),                                           # (numpy's generators: a traceback)
    (["--seed", "100000000000000000000"], "seed"),                        # (torch.manual_seed: an overflow)
    (["--seed", str(2 ** 47)], "seed"),                                   # (seed x 100003 + rank: 64 bits)
    (["--global-batch", "9223372036854775808"], "global_batch"),
    (["--subset", "99999999999999999999"], "subset"),
    (["--dbs-interval", "\u00b2"], "dbs_interval"),                       # (a digit to str.isdigit, not to int)
    (["--synthetic-classes", "1"], "synthetic_classes"),
    (["--strategy", "dbs", "--time-budget", "0.5"], "time_budget"),       # (ignored under dbs: it ran to the end)
    (["--strategy", "ssgd", "--softsync-n", "7"], "softsync_n"),
    (["--strategy", "static", "--staleness-lr"], "staleness_lr"),
])
def test_bad_values_name_the_field(argv, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        parse_train_args(argv)


def test_a_boolean_flag_alone_means_true():
    assert parse_train_args(["--sync-bn", "--model", "resnet20"]).sync_bn is True
    assert parse_train_args(["--sync-bn", "false"]).sync_bn is False
    assert parse_train_args([]).sync_bn is False


def test_unknown_option_and_key(tmp_path):
    with pytest.raises(UserError, match="--no-such-option"):
        parse_train_args(["--no-such-option", "1"])
    f = tmp_path / "bad.toml"
    f.write_text("global_bach = 3\n")
    with pytest.raises(ConfigError, match="^global_bach: unknown configuration key"):
        parse_train_args(["--config", str(f)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_train_args(["--config", str(tmp_path / "missing.toml")])
    f.write_text("global_batch = [\n")
    with pytest.raises(ConfigError, match="cannot read"):
        parse_train_args(["--config", str(f)])


def test_world_dependent_checks():
    with pytest.raises(ConfigError, match="^speeds: has 2 values but there are 3 ranks"):
        config.check_world(Config(speeds=(1.0, 0.5)), 3)
    with pytest.raises(ConfigError, match="^global_batch: 2 is smaller"):
        config.check_world(Config(global_batch=2), 3)
    config.check_world(Config(global_batch=3, speeds=(1.0, 1.0, 0.1)), 3)
    with pytest.raises(ConfigError, match="^couple: names rank 3 but ranks are 0..2"):
        config.check_world(Config(couple="0:2,3:2"), 3)
    config.check_world(Config(couple="0:2, 2:1.5"), 3)


def test_couple_is_read_per_rank():
    c = parse_train_args(["--couple", "0:3,2:1.5"])
    assert config.parse_couple(c.couple) == {0: 3.0, 2: 1.5} and config.parse_couple("") == {}


def test_frozen_and_typed():
    with pytest.raises(Exception):
        Config().epochs = 3
    with pytest.raises(ConfigError, match="^epochs: expected int"):
        Config(epochs="3")


def test_every_field_has_a_comment():
    assert all(comment for _, _, comment in config.describe())


_values = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.floats(-2, 2), max_size=4))


@given(st.dictionaries(st.sampled_from(sorted(config.FIELDS) + ["bogus"]), _values, max_size=6))
@settings(max_examples=400, deadline=None)
def test_random_values_give_a_config_or_a_config_error(values):
    values = {k: v for k, v in values.items() if v is not None}
    try:
        c = config.from_dict(values)
    except ConfigError as exc:
        assert str(exc).split(":")[0] in config.FIELDS or str(exc).startswith("bogus")
    else:
        config.validate(c)


_tokens = st.sampled_from(["--global-batch", "--speeds", "--epochs", "--strategy", "--lr", "--seed", "--progress",
                           "--bogus", "--synthetic-shape", "--sleep-epochs", "-x", "1", "0", "-1", "1,0.5",
                           "nan", "dbs", "true", "3x32x32", "", "1e9", "0.0"])


@given(st.lists(_tokens, max_size=8))
@settings(max_examples=400, deadline=None)
def test_random_command_lines_give_a_config_or_a_user_error(argv):
    """Malformed command lines give a clear error (UserError, shown as one line), never a traceback."""
    try:
        parse_train_args(argv)
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc)


def test_max_local_batch_bounds_what_a_rank_computes_at_once():
    """Where a rank can accumulate it is the micro-batch bound (a larger share runs in
    micro-batches of it); with SyncBatchNorm or a parameter server, the share's bound."""
    c = parse_train_args(["--max-local-batch", "12"])
    assert (c.share_bound, c.micro_size) == (0, 12)
    assert parse_train_args(["--max-local-batch", "12", "--micro-batch", "5"]).micro_size == 5
    assert parse_train_args(["--max-local-batch", "4", "--micro-batch", "5"]).micro_size == 4
    bn = parse_train_args(["--max-local-batch", "12", "--sync-bn", "--model", "resnet20", "--norm", "batch"])
    assert (bn.share_bound, bn.micro_size) == (12, 0)
    ps = parse_train_args(["--max-local-batch", "12", "--strategy", "asgd"])
    assert (ps.share_bound, ps.micro_size) == (12, 0)
