"""Load a campaign config from a YAML preset plus ``--set key=value`` overrides.

Errors name the file and the dotted key: ``configs/x.yaml: calibration.intervl:
unknown key`` rather than a pydantic dump. Presets live in ``configs/``; a bare
name (``tiny-cpu``) resolves there.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fp8rl_core.config.campaign import CampaignConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_PRESET = "tiny-cpu"


class ConfigError(ValueError):
    """A config that cannot be loaded; the message is one line for the user."""


# A config file is read as plain YAML: one meaning per text. Refused: a key given twice (YAML keeps the last,
# silently dropping a whole section), anchors and aliases (shared values, and the way to expand a few lines
# into gigabytes), merge keys, explicit tags, and YAML 1.1's sexagesimal and leading-zero octal numbers
# (``1:30`` is 90, ``010`` is 8): those stay text, so ``010`` reads as written (ten) and a number field
# refuses ``1:30`` by name.
MAX_CONFIG_BYTES = 1 << 20
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"


class _Refused(Exception):
    def __init__(self, mark, what: str) -> None:
        where = f"line {mark.line + 1}: " if mark is not None else ""
        super().__init__(where + what)


class PlainYamlLoader(yaml.SafeLoader):
    """SafeLoader without YAML's silent resolutions (see above); refusals raise with the line."""

    yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(event.start_mark, f"alias *{event.anchor}: anchors and aliases are not allowed in a config")
        if getattr(event, "anchor", None) is not None:
            raise _Refused(event.start_mark, f"anchor &{event.anchor}: anchors and aliases are not allowed in a config")
        if getattr(event, "tag", None) not in (None, "!"):
            raise _Refused(event.start_mark, f"tag {event.tag}: explicit YAML tags are not allowed in a config")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise _Refused(key_node.start_mark, "merge key <<: not allowed in a config (write the keys out)")
            key = (key_node.tag, key_node.value) if isinstance(key_node, yaml.ScalarNode) else id(key_node)
            if key in seen:
                raise _Refused(
                    key_node.start_mark,
                    f"key {key_node.value!r} appears twice in one mapping (first on line {seen[key] + 1})",
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


PlainYamlLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?0|[-+]?[1-9][0-9_]*|0x[0-9a-fA-F_]+)$"), list("-+0123456789")
)
PlainYamlLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def read_yaml(text: str) -> Any:
    """Parse config ``text`` with :class:`PlainYamlLoader`; refusals and syntax errors are one-line ConfigErrors
    (without the file name: callers add it)."""
    if len(text.encode()) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{len(text.encode())} bytes: a config is at most {MAX_CONFIG_BYTES} bytes")
    try:
        return yaml.load(text, Loader=PlainYamlLoader)
    except _Refused as err:
        raise ConfigError(str(err)) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"not valid YAML ({str(err).splitlines()[0]})") from None
    except RecursionError:
        raise ConfigError("nested too deeply to be a config") from None


def resolve_preset(name_or_path: str | Path | None) -> Path:
    if name_or_path is None:
        name_or_path = DEFAULT_PRESET
    p = Path(name_or_path)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / f"{name_or_path}.yaml", CONFIG_DIR / str(name_or_path)):
        if cand.is_file():
            return cand
    raise ConfigError(f"config not found: {name_or_path} (looked in . and {CONFIG_DIR})")


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. calibration.interval=10")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = read_yaml(raw) if raw.strip() else None
    except ConfigError as err:
        if "not valid YAML" not in str(err):
            raise ConfigError(f"--set {item!r}: {err}") from None
        value = raw
    return key.split("."), value


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part} is not a section")
        node = nxt
    node[path[-1]] = value


def _format_error(source: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown key")
        else:
            parts.append(f"{loc}: {e['msg'].removeprefix('Value error, ')}")
    return f"{source}: " + "; ".join(parts)


def config_from_dict(
    data: dict, *, source: str = "<dict>", overrides: list[str] | tuple[str, ...] = ()
) -> CampaignConfig:
    tree = copy.deepcopy(data) if data else {}
    for item in overrides:
        path, value = _parse_override(item)
        _set_path(tree, path, value)
    src = source + (" (with --set overrides)" if overrides else "")
    _refuse_bools_as_numbers(tree, src)
    try:
        cfg = CampaignConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(src, err)) from None
    from fp8rl_core.registered import unknown_names  # the registries are the one list of names

    bad = unknown_names(cfg)
    if bad:
        raise ConfigError(f"{src}: " + "; ".join(bad))
    return cfg


def _refuse_bools_as_numbers(tree: dict, src: str) -> None:
    """``steps: true`` (or ``yes``, YAML's boolean) is not the integer 1: booleans are not numbers.

    pydantic's lax mode converts them; its strict mode (on the JSON form, where
    lists and strings still fill tuples and enums) names them. Only errors on a
    boolean input are raised here, so every other lax conversion stays as it was.
    """
    try:
        CampaignConfig.model_validate_json(json.dumps(tree, default=str), strict=True)
    except ValidationError as err:
        bad = [e for e in err.errors() if isinstance(e.get("input"), bool)]
        if bad:
            parts = [
                f"{'.'.join(str(x) for x in e['loc'])}: {e['input']!r} is a boolean, not a number ({e['msg'].lower()})"
                for e in bad
            ]
            raise ConfigError(f"{src}: " + "; ".join(parts)) from None


def load_config(preset: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> CampaignConfig:
    path = resolve_preset(preset)
    try:
        data = read_yaml(path.read_text())
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); a config is a YAML file") from None
    if data is None or data == {}:
        raise ConfigError(
            f"{path}: the config file is empty (no settings); start from a preset, e.g. configs/{DEFAULT_PRESET}.yaml"
        )
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    return config_from_dict(data, source=str(path), overrides=overrides)


def dump_config(cfg: CampaignConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
