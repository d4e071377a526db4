"""Config: schema validation, clear errors, TOML files, method specs, digests."""

from __future__ import annotations

import pytest

from commpress.config import Config, ConfigError, parse_method_spec
from commpress.config.groups import MethodGroups


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
        ({"backend": "nccl"}, "backend = 'nccl' is not accepted; expected one of 'torch', 'mpi'"),
        (
            {"method": "none", "params": {"rank": 4}},
            "unknown key 'rank': it belongs in [params] of method acpsgd or powersgd or in [dion]; accepted keys: none",
        ),
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


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (
            {"rank": 4},
            "unknown config key 'rank': it belongs in [params] of method acpsgd or powersgd or in [dion]; accepted keys: method",
        ),
        (
            {"method": "powersgd", "params": {"start_iter": 3}},
            "unknown key 'start_iter': it belongs at the top level (before any [table])",
        ),
        ({"period": 4}, "unknown config key 'period': it belongs in [local_sgd]; accepted keys"),
        ({"fsdp": {"period": 4}}, "fsdp: unknown key 'period': it belongs in [local_sgd]; accepted keys: bucket_size"),
        ({"local_sgd": {"grad_bits": 8}}, "local_sgd: unknown key 'grad_bits': it belongs in [fsdp]"),
        (
            {"bandwidth": {"method": "fp16"}},
            "[bandwidth]: unknown key 'method': it belongs at the top level (before any [table]) or in [[overrides]]",
        ),
        (
            {"overrides": [{"params": ["*"], "rank": 2}]},
            "overrides[0]: unknown key 'rank': it belongs in this override's method_params",
        ),
        (
            {"method": "topk", "params": {"rank": 2}},
            "method 'topk': unknown key 'rank': it belongs in [params] of method acpsgd or powersgd",
        ),
    ],
)
def test_a_key_in_the_wrong_table_names_the_table_it_belongs_in(data, needle):
    with pytest.raises(ConfigError) as err:
        Config.load(data)
    assert needle in str(err.value)


def test_json_file_holds_the_same_schema(tmp_path):
    (tmp_path / "c.json").write_text(
        '{"method": "bf16", "start_iter": 2, "overrides": [{"params": ["*.bias"], "method": "none"}], '
        '"local_sgd": {"qsr_alpha": null}}'
    )
    (tmp_path / "c.toml").write_text(
        'method = "bf16"\nstart_iter = 2\n[[overrides]]\nparams = ["*.bias"]\nmethod = "none"\n[local_sgd]\n'
    )
    assert Config.load(tmp_path / "c.json") == Config.load(str(tmp_path / "c.toml"))


@pytest.mark.parametrize(
    ("name", "text", "needle"),
    [
        ("c.yaml", "method: bf16\n", "has suffix '.yaml'; accepted: .toml (TOML) or .json (JSON)"),
        ("commpress", 'method = "bf16"\n', "has suffix '(none)'; accepted: .toml"),
        ("c.json", '{"method": "bf16",}', "is not valid JSON: "),
        ("c.json", '["bf16"]', "holds a JSON list; expected one object of settings"),
        ("c.json", '{"method": "bf16", "method": "fp16"}', "key 'method' appears twice in one JSON object"),
        ("c.json", '{"method": "bf16", "rank": 4}', "unknown config key 'rank': it belongs in [params]"),
    ],
)
def test_config_file_formats_and_their_errors(tmp_path, name, text, needle):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError) as err:
        Config.load(tmp_path / name)
    assert needle in str(err.value)


def test_a_method_name_given_as_a_file_suggests_the_dict(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"config file 'bf16' does not exist; 'bf16' is a method name: .*pass a dict: \{\"method\": \"bf16\"\}"
    ):
        Config.load("bf16")


def test_toml_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('method = "bf16"\nstart_iter = 2\n[[overrides]]\nparams = ["*.bias", "*norm*"]\nmethod = "none"\n')
    cfg = Config.load(path)
    assert cfg.method == "bf16" and cfg.start_iter == 2
    groups = MethodGroups(cfg)
    assert [groups.key_for(n) for n in ("body.0.bias", "layernorm.weight", "body.0.weight")] == ["override0", "override0", "main"]
    assert groups.specs["override0"] == ("none", {}) and groups.specs["main"] == ("bf16", {})


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


INF = float("inf")


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"method": ["powersgd"]}, "method = ['powersgd'] is not accepted; expected a compressor name, one of: acpsgd"),
        ({"method": {"name": "fp16"}}, "method = {'name': 'fp16'} is not accepted"),
        ({"method": 16}, "method = 16 is not accepted"),
        ({"start_iter": True}, "start_iter = True is not accepted; expected an integer >= 0"),
        ({"backend": ["torch"]}, "backend = ['torch'] is not accepted"),
        ({"method": "powersgd", "params": {"rank": "4"}}, "rank = '4' is not accepted; expected an integer"),
        ({"method": "powersgd", "params": {"rank": True}}, "rank = True is not accepted; expected an integer"),
        ({"method": "powersgd", "params": {"warm_start": 1}}, "warm_start = 1 is not accepted; expected true or false"),
        ({"method": "topk", "params": {"selection": "fast"}}, "selection = 'fast' is not accepted; expected one of 'auto'"),
        ({"method": "topk", "params": {"ratio": INF}}, "ratio = inf is not accepted; expected a finite number"),
        ({"method": "topk", "params": {"ratio": float("nan")}}, "ratio = nan is not accepted; expected a finite number"),
        ({"method": "powersgd", "params": {"min_compression_rate": INF}}, "min_compression_rate = inf is not accepted"),
        ({"method": "terngrad", "params": {"clip_sigma": -INF}}, "clip_sigma = -inf is not accepted"),
        ({"method": "terngrad", "params": {"clip_sigma": 10**400}}, "clip_sigma = 1000"),  # too large for a float
        ({"overrides": [{"params": 5}]}, "overrides[0]: params = 5 is not accepted; expected a list of parameter-name globs"),
        ({"overrides": [{"params": ["*", 5]}]}, "overrides[0]: params = ['*', 5] is not accepted"),
        ({"overrides": [5]}, "overrides[0] = 5 is not accepted; expected a table"),
        ({"overrides": [{"params": ["*"], "method_params": 5}]}, "overrides[0]: method_params = 5 is not accepted"),
        ({"overrides": [{"params": ["*"], "method_params": "abc"}]}, "overrides[0]: method_params = 'abc' is not accepted"),
        ({"overrides": [{"params": ["*"], "method": ["fp16"]}]}, "overrides[0]: method = ['fp16'] is not accepted"),
        (
            {"overrides": [{"params": ["*"], "method": "powersgd", "method_params": {"rank": 0}}]},
            "overrides[0]: method 'powersgd': rank = 0 is not accepted",
        ),
        (
            {"overrides": [{"params": ["*"], "method": "topk", "method_params": {"ratio": INF}}]},
            "overrides[0]: method 'topk': ratio = inf is not accepted",
        ),
        ({1: "fp16"}, "config: key 1 is not accepted; setting names are strings"),
        ({"method": "fp16", 2: 3}, "config: key 2 is not accepted"),
        ({"method": "powersgd", "params": {1: 2, "rank": 3}}, "params: key 1 is not accepted"),
        ({"overrides": [{"params": ["*"], 1: 2}]}, "overrides[0]: key 1 is not accepted"),
        ({"overrides": [{"params": ["*"], "method_params": {1: 2}}]}, "overrides[0]: method_params: key 1 is not accepted"),
        ({"local_sgd": {1: 2, "period": 3}}, "local_sgd: key 1 is not accepted"),
        ({"fsdp": {("a",): 1}}, "fsdp: key ('a',) is not accepted"),
        ({"bandwidth": {None: 1}}, "[bandwidth]: key None is not accepted"),
    ],
)
def test_bad_values_of_any_type_name_the_key(data, needle):
    with pytest.raises(ConfigError) as err:
        Config.load(data)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("table", "key", "value"),
    [
        ("local_sgd", "qsr_alpha", INF),
        ("local_sgd", "qsr_power", INF),
        ("local_sgd", "outer_lr", INF),
        ("local_sgd", "outer_momentum", float("nan")),
        ("local_sgd", "staleness_penalty", INF),
        ("local_sgd", "clip", INF),
        ("local_sgd", "period", 2.5),
        ("local_sgd", "warmup_steps", True),
        ("fsdp", "weight_bits", 8.0),
        ("fsdp", "exclude", [1]),
        ("bandwidth", "budget_ms", INF),
        ("bandwidth", "slowdown", INF),
        ("bandwidth", "min_ratio", float("nan")),
        ("bandwidth", "max_ratio", INF),
        ("bandwidth", "fast_gbps", INF),
        ("bandwidth", "probe_ms", INF),
        ("bandwidth", "remeasure_every", 1.5),
        ("bandwidth", "domains", [[0, "1"]]),
    ],
)
def test_every_table_rejects_bad_types_and_infinite_numbers(table, key, value):
    with pytest.raises(ConfigError) as err:
        Config.load({table: {key: value}})
    assert f"{key} = {value!r} is not accepted" in str(err.value)


def test_tables_built_directly_are_checked_too():
    from commpress.config.tables import BandwidthConfig, FSDPConfig, LocalSGDConfig

    with pytest.raises(ConfigError, match="local_sgd: qsr_alpha = inf is not accepted"):
        LocalSGDConfig(qsr_alpha=INF)
    with pytest.raises(ConfigError, match=r"\[bandwidth\]: domains = \[\[0, 'a'\]\] is not accepted"):
        BandwidthConfig(domains=[[0, "a"]])
    with pytest.raises(ConfigError, match="fsdp: bucket_size = '8' is not accepted"):
        FSDPConfig(bucket_size="8")
    assert FSDPConfig(exclude=["*.bias"]).exclude == ("*.bias",)
    assert BandwidthConfig(budget_ms=5).budget_ms == 5.0 and isinstance(BandwidthConfig(budget_ms=5).budget_ms, float)


def _latin1(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('method = "fp16" # caf\xe9\n'.encode("latin-1"))
    return path


def _symlink_loop(tmp_path):
    (tmp_path / "a.toml").symlink_to(tmp_path / "b.toml")
    (tmp_path / "b.toml").symlink_to(tmp_path / "a.toml")
    return tmp_path / "a.toml"


@pytest.mark.parametrize(
    ("make_path", "needle"),
    [
        (_latin1, "is not UTF-8 text"),
        (lambda tmp: tmp, "is a directory"),
        (lambda tmp: "", "config file '' is not accepted"),
        (lambda tmp: str(tmp / "a\0b.toml"), "is not accepted: embedded null byte"),
        (lambda tmp: str(tmp / ("x" * 300)), "cannot be read: File name too long"),
        (_symlink_loop, "cannot be read: Too many levels of symbolic links"),
    ],
    ids=["not-utf8", "directory", "empty", "nul", "too-long", "symlink-loop"],
)
def test_unreadable_config_files_name_the_path(tmp_path, make_path, needle):
    path = make_path(tmp_path)
    with pytest.raises(ConfigError) as err:
        Config.load(path)
    message = str(err.value)
    assert needle in message and message.startswith(f"config file {str(path)!r}"[:40])


def test_unmatched_overrides():
    cfg = Config.load(
        {
            "method": "fp16",
            "overrides": [
                {"params": ["*.bias", "*nrom*"], "method": "none"},
                {"params": ["embed.*", "*.bias", "head.weight"], "method": "bf16"},
            ],
        }
    )
    names = ["embed.weight", "body.0.weight", "body.0.bias", "norm.weight"]
    assert cfg.unmatched_overrides(names) == ["*nrom*", "head.weight"]
    assert cfg.unmatched_overrides(iter([*names, "head.weight", "a.nrom.b"])) == []
    assert cfg.unmatched_overrides([]) == ["*.bias", "*nrom*", "embed.*", "head.weight"]
    assert Config.load({"method": "fp16"}).unmatched_overrides(names) == []
