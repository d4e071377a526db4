"""The command-line grammar every command shares: method lists, plain lists, range checks."""

from __future__ import annotations

import argparse

import pytest

from commpress.bench.arguments import choice, integer, listed, method_list, number, split_method_list
from commpress.cmdline import parse_method_spec
from commpress.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "specs"),
    [
        ("none", ["none"]),
        ("none,fp16", ["none", "fp16"]),
        ("none;fp16", ["none", "fp16"]),
        (" none ; fp16 ;", ["none", "fp16"]),
        ("none,powersgd:rank=4,start_iter=2,bf16", ["none", "powersgd:rank=4,start_iter=2", "bf16"]),
        ("none;powersgd:rank=4,start_iter=2;bf16", ["none", "powersgd:rank=4,start_iter=2", "bf16"]),
        ("topk:ratio=0.01,min_numel=0,none", ["topk:ratio=0.01,min_numel=0", "none"]),
        ("none,fp16;topk:ratio=0.01", ["none", "fp16", "topk:ratio=0.01"]),
        ("q4:weight_bits=4,exclude=['*norm*']", ["q4:weight_bits=4,exclude=['*norm*']"]),
        ("torch-powersgd:rank=2,local-sgd+qsr", ["torch-powersgd:rank=2", "local-sgd+qsr"]),
        ("", []),
        (" ; , ", []),
    ],
)
def test_method_lists_split_on_semicolons_and_commas_alike(text, specs):
    assert split_method_list(text) == specs


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rank=4", r"setting 'rank=4' follows no method; settings go after NAME:"),
        ("topk:ratio=0.01;min_numel=0", r"setting 'min_numel=0' follows no method"),
        ("topk,ratio=0.01", r"setting 'ratio=0.01' follows 'topk' without a colon; write 'topk:ratio=0.01'"),
        (":rank=4", r"':rank=4' has no method name"),
        ("fp16,none;fp16", r"'fp16' is named twice"),
    ],
)
def test_method_list_errors_say_what_to_write(text, message):
    with pytest.raises(ConfigError, match=message):
        split_method_list(text)


def test_every_spec_of_a_list_reads_as_its_config():
    specs = split_method_list("none,powersgd:rank=4,start_iter=20,backend=torch,topk:ratio=0.01")
    assert [parse_method_spec(s) for s in specs] == [
        {"method": "none", "params": {}},
        {"method": "powersgd", "params": {"rank": 4}, "start_iter": 20, "backend": "torch"},
        {"method": "topk", "params": {"ratio": 0.01}},
    ]


def test_argparse_types_name_the_range():
    with pytest.raises(argparse.ArgumentTypeError, match=r"'0' is not accepted; expected an integer >= 1"):
        integer(1)("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"'9' is not accepted; expected an integer from 1 to 8"):
        integer(1, 8)("9")
    with pytest.raises(argparse.ArgumentTypeError, match=r"'1.5' is not accepted; expected a number in \(0, 1\]"):
        number(0, 1)("1.5")
    with pytest.raises(argparse.ArgumentTypeError, match=r"'-1' is not accepted; expected a finite number >= 0"):
        number(0, low_open=False)("-1")
    assert number(0, 1)("1") == 1.0 and number(0, low_open=False)("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError, match=r"' ; ' names no method"):
        method_list()(" ; ")
    assert method_list(allow_empty=True)("") == []


def test_plain_lists_take_both_separators():
    assert listed(integer(1))("1,2;4") == [1, 2, 4]
    assert listed(choice(("sgd", "adamw")))("adamw; sgd") == ["adamw", "sgd"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"'lion' is not accepted; accepted: sgd, adamw"):
        listed(choice(("sgd", "adamw")))("sgd,lion")
    with pytest.raises(argparse.ArgumentTypeError, match=r"names nothing"):
        listed(integer(1))(",")
