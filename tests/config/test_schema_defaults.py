"""Each key's default and help live once, in its schema: no YAML under conf/ repeats a default, the default job
shows the schemas' defaults wherever its options leave them, and `run --help <group>` prints each help whole."""

import subprocess
import sys
import typing
from dataclasses import MISSING, fields, is_dataclass

import yaml
from omegaconf import OmegaConf

from runner.cli.compose import CONF_DIR, GROUP_DIRS, SCHEMAS
from runner.cli.help import option_values
from runner.config.fields import help_of
from runner.config.spec import RunSpec
from tests.support.command import run_cli


def option_schema(path):
    """The schema an option starts from: `/schema/<group>/<name>@_here_` in its defaults list."""
    entries = (yaml.safe_load(path.read_text()) or {}).get("defaults", [])
    return next(
        (e.split("/")[3].split("@")[0] for e in entries if isinstance(e, str) and e.startswith("/schema/")), None
    )


def schema_of(group: str, option_file) -> type:
    schemas = SCHEMAS.get(group) or {"base": typing.get_type_hints(RunSpec)[group]}
    return schemas[option_schema(option_file) or "base"]


def nested_schema(schema: type, key: str):
    kind = typing.get_type_hints(schema).get(key)
    return next((t for t in (kind, *typing.get_args(kind)) if is_dataclass(t)), None)


def repeated_defaults(schema: type, body: dict, prefix: str = "") -> list[str]:
    """The keys of an option's body whose values, typed as its schema types them, are the schema's defaults."""
    typed = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(schema), body), enum_to_str=True)
    defaults = OmegaConf.to_container(OmegaConf.structured(schema), enum_to_str=True)
    repeats = []
    for key, value in body.items():
        inner = nested_schema(schema, key)
        if isinstance(value, dict) and value and inner is not None:
            repeats += repeated_defaults(inner, value, f"{prefix}{key}.")
        elif isinstance(value, str) and ("${" in value or value == "???"):
            continue
        elif key in defaults and typed[key] == defaults[key]:
            repeats.append(f"{prefix}{key}")
    return repeats


def test_no_yaml_under_conf_repeats_a_schema_default():
    repeats = {}
    for group_dir in GROUP_DIRS:
        for option in sorted(group_dir.glob("*.yaml")):
            body = {k: v for k, v in (yaml.safe_load(option.read_text()) or {}).items() if k != "defaults"}
            found = repeated_defaults(schema_of(group_dir.name, option), body)
            if found:
                repeats[f"{group_dir.name}/{option.name}"] = found
    primary = {
        k: v
        for k, v in yaml.safe_load((CONF_DIR / "config.yaml").read_text()).items()
        if k not in ("defaults", "hydra")
    }
    assert primary == {}, "the primary config sets values of the spec; its options and schemas hold them"
    assert repeats == {}, f"YAML options repeat their schemas' defaults: {repeats}"


def test_the_check_above_finds_a_repeated_default():
    from runner.strategies.fsdp import FSDPStrategy

    assert repeated_defaults(FSDPStrategy, {"sharding_strategy": "FULL_SHARD", "tp_size": 2}) == ["sharding_strategy"]
    assert repeated_defaults(typing.get_type_hints(RunSpec)["tracker"], {"wandb": {"mode": "offline"}}) == [
        "wandb.mode"
    ]


def flat(node, prefix=""):
    if isinstance(node, dict) and node:
        return {k: v for key, value in node.items() for k, v in flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def test_the_default_job_shows_the_schemas_defaults_where_its_options_leave_them(workdir):
    shown = yaml.safe_load(run_cli("--cfg", "job", cwd=workdir).stdout)
    chosen = dict(
        entry.popitem()
        for entry in yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
        if isinstance(entry, dict) and entry
    )
    hints = typing.get_type_hints(RunSpec)
    differ = {}
    for section in (f.name for f in fields(RunSpec)):
        if section in chosen:
            option = CONF_DIR / section / f"{chosen[section]}.yaml"
            schema, set_by_option = schema_of(section, option), dict(option_values(option))
        else:
            schema, set_by_option = hints[section], {}
        default = (
            OmegaConf.to_container(OmegaConf.structured(schema), enum_to_str=True)
            if is_dataclass(schema)
            else next(f.default for f in fields(RunSpec) if f.name == section)
        )
        # hardware=auto leaves to the machine what it detects: the keys unset or `auto` in its schema
        detected = {f.name for f in fields(schema) if f.default in (None, "auto")} if section == "hardware" else set()
        expected, actual = flat(default), flat(shown[section])
        for key, value in actual.items():
            if (
                key.split(".")[0] not in set_by_option
                and key not in set_by_option
                and key not in detected
                and expected.get(key, value) != value
            ):
                differ[f"{section}.{key}"] = (expected[key], value)
    assert differ == {}, "(schema default, run --cfg job) of keys the default options do not set"


def schemas_reachable() -> set[type]:
    found, todo = set(), [RunSpec, *(s for schemas in SCHEMAS.values() for s in schemas.values())]
    while todo:
        schema = todo.pop()
        if schema in found:
            continue
        found.add(schema)
        for kind in typing.get_type_hints(schema).values():
            todo += [
                t
                for t in (kind, *typing.get_args(kind), *(a for t in typing.get_args(kind) for a in typing.get_args(t)))
                if is_dataclass(t)
            ]
    return found


def test_every_key_of_every_schema_has_its_help():
    unhelped = [
        f"{schema.__name__}.{f.name}"
        for schema in schemas_reachable()
        for f in fields(schema)
        if not help_of(f).strip()
    ]
    assert len(schemas_reachable()) > 25 and unhelped == []


def test_run_help_of_a_group_prints_each_key_s_default_and_whole_help(workdir):
    from runner.config.training import TrainConfig

    probe = (
        'import sys; sys.argv = ["run", "--help", "train"]; from runner.cli.main import main; main(); '
        'print("torch imported:", "torch" in sys.modules)'
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=workdir, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for key in fields(TrainConfig):
        default = key.default if key.default is not MISSING else key.default_factory()
        default = str(default).lower() if isinstance(default, bool) else "null" if default is None else default
        assert (
            f"{key.name}: {getattr(default, 'value', default)} {help_of(key)}" in text
            or f"{key.name}: {getattr(default, 'value', default)} (" in text
        )
        assert help_of(key) in text
    assert "torch imported: False" in result.stdout
    strategy = run_cli("--help", "strategy", cwd=workdir).stdout
    assert "strategy=fsdp: torch FSDP2" in strategy and "sharding_strategy: FULL_SHARD" in strategy


def test_run_help_of_an_unknown_group_is_one_line(workdir):
    result = run_cli("--help", "strateg", cwd=workdir)
    assert result.returncode == 2 and result.stdout == ""
    assert (
        result.stderr.strip().startswith("run: error: no config group strateg")
        and "did you mean strategy?" in result.stderr
        and len(result.stderr.strip().splitlines()) == 1
    )
