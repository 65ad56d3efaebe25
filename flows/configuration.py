"""Load a campaign config from a YAML preset plus ``--set key=value`` overrides.

Errors name the file and the dotted key: ``configs/x.yaml: calibration.intervl:
unknown key`` rather than a pydantic dump. Presets live in ``configs/``; a bare
name (``tiny-cpu``) resolves there.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from fp8rl_core.config import CampaignConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PRESET = "tiny-cpu"


class ConfigError(ValueError):
    """A config that cannot be loaded; the message is one line for the user."""


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
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
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
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
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
