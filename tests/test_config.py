"""config.py: strict YAML loading, --set overrides with type coercion, error lines, resolved config."""

from __future__ import annotations

from typing import Literal

import pytest
import yaml

from agentrl.config import ConfigError, StrictModel, load_model, parse_override, write_resolved


class Inner(StrictModel):
    lr: float = 1e-6
    steps: int = 10
    name: str = "run"
    mode: Literal["grpo", "ppo"] = "grpo"
    limit: int | None = None
    tag: str | None = None


class Outer(StrictModel):
    seed: int = 0
    flags: list[int] = []
    inner: Inner = Inner()
    params: dict[str, float] = {}


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 3\ninner:\n  steps: 5\n")
    return path


def test_load_plain(cfg_file):
    cfg = load_model(Outer, cfg_file)
    assert (cfg.seed, cfg.inner.steps, cfg.inner.lr) == (3, 5, 1e-6)


@pytest.mark.parametrize(
    ("override", "getter", "expected"),
    [
        ("seed=7", lambda c: c.seed, 7),
        ("inner.lr=3e-4", lambda c: c.inner.lr, 3e-4),
        ("inner.steps=12", lambda c: c.inner.steps, 12),
        ("flags=[1, 2, 3]", lambda c: c.flags, [1, 2, 3]),
        ("inner.name=no", lambda c: c.inner.name, "no"),  # a str field keeps YAML's "no" as text
        ("inner.name=123", lambda c: c.inner.name, "123"),
        ("inner.mode=ppo", lambda c: c.inner.mode, "ppo"),
        ("inner.limit=null", lambda c: c.inner.limit, None),
        ("inner.limit=4", lambda c: c.inner.limit, 4),
        ("inner.tag=null", lambda c: c.inner.tag, None),
        ("inner.tag=a=b", lambda c: c.inner.tag, "a=b"),  # only the first '=' splits
        ("params.kl=0.5", lambda c: c.params, {"kl": 0.5}),  # free-form mappings take new keys
    ],
)
def test_overrides_coerce_by_field_type(cfg_file, override, getter, expected):
    assert getter(load_model(Outer, cfg_file, [override])) == expected


def test_override_later_wins_and_file_keeps_other_keys(cfg_file):
    cfg = load_model(Outer, cfg_file, ["inner.steps=1", "inner.steps=2"])
    assert (cfg.seed, cfg.inner.steps) == (3, 2)


def test_unknown_override_key_names_path_and_suggests(cfg_file):
    with pytest.raises(ConfigError) as e:
        load_model(Outer, cfg_file, ["inner.stpes=3"])
    msg = str(e.value)
    assert "'inner.stpes'" in msg and "did you mean 'steps'" in msg


def test_unknown_file_key_names_file_and_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("inner:\n  stepz: 3\n")
    with pytest.raises(ConfigError) as e:
        load_model(Outer, path)
    msg = str(e.value)
    assert str(path) in msg and "'inner.stepz'" in msg and "did you mean 'steps'" in msg
    assert len(msg.splitlines()) == 1


def test_wrong_type_names_file_key_value_and_expectation(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("inner:\n  steps: many\n")
    with pytest.raises(ConfigError) as e:
        load_model(Outer, path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: inner.steps: got 'many'; expected:") and "integer" in msg


def test_wrong_choice_lists_choices(cfg_file):
    with pytest.raises(ConfigError) as e:
        load_model(Outer, cfg_file, ["inner.mode=dpo"])
    assert "inner.mode" in str(e.value) and "'grpo'" in str(e.value) and "'ppo'" in str(e.value)


def test_one_line_per_problem(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("seed: x\ninner:\n  steps: y\n")
    with pytest.raises(ConfigError) as e:
        load_model(Outer, path)
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and "seed" in lines[0] and "inner.steps" in lines[1]


@pytest.mark.parametrize("text", ["noequals", "=3", "a..b=1"])
def test_malformed_override(text):
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        parse_override(text)


def test_override_through_a_scalar_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'seed.x'"):
        load_model(Outer, path, ["seed.x=1"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_model(Outer, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: [1, 2\n")
    with pytest.raises(ConfigError, match=r"invalid YAML \(line"):
        load_model(Outer, bad)
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_model(Outer, top)
    twice = tmp_path / "twice.yaml"  # plain YAML keeps the last: the first block's settings would vanish
    twice.write_text("inner:\n  steps: 5\nseed: 1\ninner:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"line 4, column 1\): key 'inner' appears twice"):
        load_model(Outer, twice)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_model(Outer, latin)


def test_quoted_string_override_loses_its_quotes(cfg_file):
    assert load_model(Outer, cfg_file, ['inner.name=" run 2 "']).inner.name == " run 2 "
    assert load_model(Outer, cfg_file, ["inner.tag='x'"]).inner.tag == "x"
    assert load_model(Outer, cfg_file, ['inner.name="a"b"']).inner.name == '"a"b"'  # not one quoted scalar


def test_write_resolved_round_trips_and_leaves_no_temp_files(tmp_path, cfg_file):
    cfg = load_model(Outer, cfg_file, ["inner.lr=0.1", "params.kl=2"])
    run = tmp_path / "run1"
    out = write_resolved(cfg, run)
    assert out == run / "config.yaml"
    assert [p.name for p in run.iterdir()] == ["config.yaml"]
    again = load_model(Outer, out)
    assert again == cfg
    assert yaml.safe_load(out.read_text())["inner"]["lr"] == 0.1
