"""The web UI (`difftune server`) and the terminal wizard (`difftune configure`).

Both are generated from the one config schema: this module turns the JSON Schema of `TrainConfig`
and of each dataset entry model into plain field descriptions (name, kind, choices, default,
description, group, advanced, path kind). The page renders them as a form and the wizard asks from
them; neither keeps a list of fields of its own.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from difftune.config.fields import GROUPS
from difftune.ui.paths import may_be_remote, path_kind

__all__ = ["GROUPS", "describe_model", "form_schema", "train_fields", "dataset_fields"]


def _split_nullable(prop: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    options = prop.get("anyOf")
    if not options:
        return prop, False
    rest = [o for o in options if o.get("type") != "null"]
    nullable = len(rest) < len(options)
    core = rest[0] if len(rest) == 1 else {"anyOf": rest}
    return core, nullable


def describe_field(name: str, prop: dict[str, Any], required: bool, defs: dict[str, Any]) -> dict[str, Any]:
    core, nullable = _split_nullable(prop)
    out: dict[str, Any] = {
        "name": name,
        "title": prop.get("title") or name.replace("_", " ").capitalize(),
        "description": prop.get("description", ""),
        "group": prop.get("group", "model"),
        "advanced": bool(prop.get("advanced", False)),
        "required": required,
        "nullable": nullable,
        "has_default": "default" in prop,
        "default": prop.get("default"),
        "path": path_kind(name, prop),
        "remote_ok": may_be_remote(prop),
    }
    for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength"):
        if bound in core:
            out[bound] = core[bound]
    if "$ref" in core:
        sub = defs.get(core["$ref"].rsplit("/", 1)[-1], {})
        out["kind"] = "object"
        out["fields"] = _fields(sub, defs)
    elif "const" in core:
        out["kind"] = "const"
        out["choices"] = [core["const"]]
    elif "enum" in core:
        out["kind"] = "choice"
        out["choices"] = list(core["enum"])
    elif core.get("type") == "array" and "$ref" not in (core.get("items") or {}):  # lists of objects: JSON
        out["kind"] = "list"
        out["item"] = (core.get("items") or {}).get("type", "string")
    elif core.get("type") in ("boolean", "integer", "number", "string"):
        out["kind"] = core["type"]
    else:
        out["kind"] = "json"
    return out


def _fields(schema: dict[str, Any], defs: dict[str, Any]) -> list[dict[str, Any]]:
    required = set(schema.get("required", []))
    return [describe_field(name, prop, name in required, defs) for name, prop in schema.get("properties", {}).items()]


def describe_model(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    return {
        "title": schema.get("title", model.__name__),
        "description": (model.__doc__ or "").strip().split("\n")[0],
        "fields": _fields(schema, schema.get("$defs", {})),
    }


def train_fields() -> list[dict[str, Any]]:
    from difftune.config import TrainConfig

    return describe_model(TrainConfig)["fields"]


def dataset_fields() -> dict[str, dict[str, Any]]:
    """dataset_type -> description of its entry model (what the schema offers, video when it lands). An 'eval'
    entry is an image entry without the keys it always refuses (they act on training only)."""
    from difftune.config.datasets import DATASET_MODELS
    from difftune.config.eval_keys import TRAINING_ONLY

    kinds = {kind: describe_model(model) for kind, model in DATASET_MODELS.items()}
    if "eval" in kinds:
        kinds["eval"]["fields"] = [f for f in kinds["eval"]["fields"] if f["name"] not in TRAINING_ONLY]
    for kind, model in DATASET_MODELS.items():
        _mark_sources(model, kinds[kind]["fields"])
    return kinds


def _mark_sources(model: type[BaseModel], fields: list[dict[str, Any]]) -> None:
    """`source`: the entry type ('aws', 'csv', 'huggingface') a key of `model` belongs to, so that a form shows it
    only for that type; `secret`: a credential, typed into a password input."""
    from difftune.config.source_aws_keys import AWS_SECRET_KEYS, AwsSource
    from difftune.config.source_csv_keys import CsvSource
    from difftune.config.source_huggingface_keys import HuggingfaceSource

    sources = {"aws": AwsSource, "csv": CsvSource, "huggingface": HuggingfaceSource}
    mixins = {name: mixin for name, mixin in sources.items() if issubclass(model, mixin)}
    for f in fields:
        f["source"] = next((name for name, mixin in mixins.items() if f["name"] in mixin.model_fields), None)
        f["secret"] = f["name"] in AWS_SECRET_KEYS and "aws" in mixins


def form_schema() -> dict[str, Any]:
    """Everything the page needs to build its forms."""
    from difftune.models.registry import FAMILY_FACTS
    from difftune.ui.confine import WEB_TYPES

    return {
        "web_types": list(WEB_TYPES),  # the dataset entry types the page offers (the others need the command line)
        "groups": list(GROUPS),
        "train": train_fields(),
        "datasets": dataset_fields(),
        "flavours": {name: list(facts.flavours) for name, facts in FAMILY_FACTS.items()},
        "default_flavour": {name: facts.default_flavour for name, facts in FAMILY_FACTS.items()},
    }
