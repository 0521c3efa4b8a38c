"""The generated command lines (pipeline/options.py): the layout a config declares, the defaults any
other model gets, and where a bad setting stops (functions raise UsageError, the parser exits 2)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict, Field

from pipeline.options import CommandLineConfig, OptionParser, UsageError, collect_options, load_yaml, merge_layer


class Inner(BaseModel):
    """Inner settings."""

    depth: int = Field(2, description="how deep")


class Declared(CommandLineConfig):
    """Declared settings."""

    name: str = Field("a", description="a name")
    size: int = Field(1, description="a size")
    hidden: int = Field(0, description="never a flag", json_schema_extra={"cli": False})
    inner: Inner = Field(default_factory=Inner)

    @classmethod
    def option_groups(cls) -> list[tuple[str, list[str]]]:
        return [("sizes", ["size"]), ("names", ["name", "hidden", "inner"])]

    @classmethod
    def cli_aliases(cls) -> dict:
        def expand(value: str) -> dict:
            if "x" not in value:
                raise ValueError(f"{value!r} is not NAMExSIZE")
            name, size = value.split("x")
            return {"name": name, "size": int(size)}

        return {"shape": (str, "NAMExSIZE: sets --name and --size", expand)}


class Plain(BaseModel):
    """Plain settings."""

    alpha: float = Field(0.5, description="a fraction")
    inner: Inner = Field(default_factory=Inner)


def test_a_command_line_config_lays_out_its_own_groups_aliases_and_hidden_fields():
    parser = OptionParser(Declared, prog="t")
    groups = [(title, [o.flag for o in options]) for title, options in collect_options(Declared)]
    assert groups == [("sizes", ["--shape", "--size"]), ("names", ["--name"]), ("Inner settings", ["--depth"])]
    config, _ = parser.parse(["--shape", "bx3", "--depth", "4"])
    assert (config.name, config.size, config.inner.depth, config.hidden) == ("b", 3, 4, 0)
    with pytest.raises(SystemExit):
        parser.parse(["--hidden", "5"])  # internal: no such flag


def test_any_other_model_gets_one_group_of_every_field():
    groups = [(title, [o.flag for o in options]) for title, options in collect_options(Plain)]
    assert groups == [("Plain settings", ["--alpha"]), ("Inner settings", ["--depth"])]
    config, _ = OptionParser(Plain, prog="t").parse(["--alpha", "0.25"])
    assert config.alpha == 0.25 and config.inner.depth == 2


def test_functions_under_the_parser_raise_usage_errors_and_the_parser_exits_2(tmp_path, capsys):
    with pytest.raises(UsageError, match="no such file"):
        load_yaml(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(UsageError, match="must hold a mapping"):
        load_yaml(str(tmp_path / "list.yaml"))
    with pytest.raises(UsageError, match="is not NAMExSIZE"):
        merge_layer(Declared, {}, {"shape": "b3"}, "")
    with pytest.raises(UsageError, match="it sets size=3, but size=4 was also given"):
        merge_layer(Declared, {}, {"shape": "bx3", "size": 4}, "")
    assert merge_layer(Declared, {"name": "a", "size": 1}, {"shape": "cx2"}, "") == {"name": "c", "size": 2}
    parser = OptionParser(Declared, prog="t")
    for argv, message in (
        (["--config", str(tmp_path / "missing.yaml")], "invalid --config: no such file"),
        (["--shape", "b3"], "invalid --shape: 'b3' is not NAMExSIZE"),
        (["--size", "-1", "--depth", "x"], "invalid int value"),
    ):
        with pytest.raises(SystemExit) as info:
            parser.parse(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_setting_of_another_job_is_named_as_such(tmp_path, capsys):
    """A --config key the config does not have (another job's setting, or a typo) says so, not pydantic's wording."""

    class Strict(CommandLineConfig):
        model_config = ConfigDict(extra="forbid")
        name: str = Field("a", description="a name")

    path = tmp_path / "c.yaml"
    path.write_text("name: b\nsample_docs: 2\n")
    with pytest.raises(SystemExit) as info:
        OptionParser(Strict, prog="jobs/x.py").parse(["--config", str(path)])
    assert info.value.code == 2
    assert "invalid sample_docs: not a setting of jobs/x.py (its settings: --help)" in capsys.readouterr().err
