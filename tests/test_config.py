"""Config: schema validation, clear errors, TOML files, method specs, digests."""

from __future__ import annotations

import pytest

from commpress.config import Config, ConfigError, parse_method_spec


def test_defaults_and_round_trip():
    cfg = Config.load({"method": "fp16", "start_iter": 3})
    assert cfg.method == "fp16" and cfg.start_iter == 3 and cfg.backend == "torch"
    assert Config.load(cfg.to_dict()) == cfg
    assert Config.load(cfg) is cfg
    assert Config.load(None).method == "none"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"method": "gzip"}, "method = 'gzip' is not a known compressor; accepted: "),
        ({"metod": "none"}, "unknown config key 'metod'; accepted keys: method"),
        ({"start_iter": -1}, "start_iter = -1"),
        ({"start_iter": 1.5}, "start_iter = 1.5"),
        ({"backend": "nccl"}, "backend = 'nccl' is not accepted; accepted: torch, mpi"),
        ({"method": "none", "params": {"rank": 4}}, "unknown key 'rank'; accepted keys: none"),
        ({"params": 3}, "params = 3"),
        ({"overrides": {"params": ["*.bias"]}}, "expected a list of tables"),
        ({"overrides": [{"params": []}]}, "overrides[0]: params = []"),
        ({"overrides": [{"params": ["*.bias"], "methd": "none"}]}, "overrides[0]: unknown key 'methd'"),
        ({"overrides": [{"params": ["*.bias"], "method": "zip"}]}, "method = 'zip'"),
    ],
)
def test_bad_config_names_key_value_and_accepted(data, needle):
    with pytest.raises(ConfigError) as err:
        Config.load(data)
    assert needle in str(err.value)


def test_toml_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('method = "bf16"\nstart_iter = 2\n[[overrides]]\nparams = ["*.bias", "*norm*"]\nmethod = "none"\n')
    cfg = Config.load(path)
    assert cfg.method == "bf16" and cfg.start_iter == 2
    assert cfg.method_for("body.0.bias") == ("none", {})
    assert cfg.method_for("layernorm.weight") == ("none", {})
    assert cfg.method_for("body.0.weight") == ("bf16", {})


def test_toml_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("method = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        Config.load(bad)


def test_digest_tracks_every_setting():
    a = Config.load({"method": "fp16"})
    assert a.digest() == Config.load({"method": "fp16"}).digest()
    assert a.digest() != Config.load({"method": "bf16"}).digest()
    assert a.digest() != Config.load({"method": "fp16", "start_iter": 1}).digest()


def test_method_spec():
    assert parse_method_spec("fp16") == {"method": "fp16", "params": {}}
    spec = parse_method_spec("none:start_iter=3,backend=mpi")
    assert spec == {"method": "none", "params": {}, "start_iter": 3, "backend": "mpi"}
    with pytest.raises(ConfigError, match="is not key=value"):
        parse_method_spec("fp16:oops")
