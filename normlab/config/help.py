"""`train.py --help-config[=WORD]`: every config key with its type, its default and what it does, read off the
schema (normlab/config/schema.py: the keys, their types, choices and bounds), configs/default.yaml (the values and
their comments) and, for the model keys that file leaves to NormLabConfig, the field's default and the docstring."""

import dataclasses
import inspect
import re
import textwrap
from pathlib import Path

import yaml

from model.configuration_normlab import NormLabConfig
from normlab.config.keys import describe
from normlab.config.schema import BOUNDS, RunConfig
from normlab.paths import REPO_ROOT

WIDTH = 100
NOTE = ("Every key of the run config: its default, type and checks, then what it does. Set any with key=value "
        "(e.g. train.lr=1e-3) or in a --config file. Defaults: {path}.")


def yaml_comments(path: Path) -> dict[str, str]:
    """{dotted key: its comment in the YAML file at `path`}: the comment on the key's line and the comment-only
    lines below it that are indented past the key."""
    text = Path(path).read_text()
    lines, docs = text.splitlines(), {}

    def walk(mapping: yaml.MappingNode, prefix: str) -> None:
        for key, value in mapping.value:
            name = prefix + key.value
            line, column = key.start_mark.line, key.start_mark.column
            same_line = value.end_mark.line == line and not isinstance(value, yaml.MappingNode)
            rest = lines[line][value.end_mark.column if same_line else key.end_mark.column:]
            parts = [rest.split("#", 1)[1].strip()] if "#" in rest else []
            for below in lines[line + 1:]:
                stripped = below.lstrip()
                if not stripped.startswith("#") or len(below) - len(stripped) <= column:
                    break
                parts.append(stripped[1:].strip())
            docs[name] = " ".join(parts)
            if isinstance(value, yaml.MappingNode):
                walk(value, name + ".")

    walk(yaml.compose(text), "")
    return docs


def model_docs() -> dict[str, str]:
    """{field: its text} from the Args section of NormLabConfig's docstring (`a, b: text` gives both)."""
    docs, names = {}, []
    args = inspect.getdoc(NormLabConfig).split("Args:", 1)[-1]
    for line in args.splitlines():
        entry = re.match(r"^ {4}([\w, ]+): (.*)", line)
        if entry:
            names = [n.strip() for n in entry[1].split(",")]
            docs.update({n: entry[2].strip() for n in names})
        elif line.startswith(" " * 8) and names:
            docs.update({n: f"{docs[n]} {line.strip()}" for n in names})
    return docs


def key_rows(path: Path) -> list[tuple[str, str, str]]:
    """(dotted key, 'default (type; choices; bounds)', doc) for every key of RunConfig, in the schema's order."""
    values = yaml.safe_load(Path(path).read_text())
    comments, from_model = yaml_comments(path), model_docs()
    model_defaults = {f.name: f.default for f in dataclasses.fields(NormLabConfig)}
    rows = []

    def walk(schema, prefix: str, given: dict) -> None:
        for f in dataclasses.fields(schema):
            key = prefix + f.name
            if dataclasses.is_dataclass(f.type):
                walk(f.type, key + ".", given.get(f.name) or {})
                continue
            checks = [f"one of: {', '.join(map(str, f.metadata['choices']))}"] if "choices" in f.metadata else []
            checks += [f"{sign} {f.metadata[b]}" for b, (sign, _) in BOUNDS.items() if b in f.metadata]
            model_doc = from_model.get(f.name, "") if prefix == "model." else ""
            if f.name in given:
                default, doc = given[f.name], comments.get(key) or model_doc
            else:  # a model key the defaults file leaves to NormLabConfig
                default, doc = model_defaults[f.name], f"{model_doc} (NormLabConfig's default)".strip()
            shown = yaml.safe_dump(default, default_flow_style=True, width=1000).strip().removesuffix("...").strip()
            rows.append((key, f"{shown} ({'; '.join([describe(f.type, items=True)] + checks)})", doc))

    walk(RunConfig, "", values)
    return rows


def help_text(path: Path, word: str | None = None) -> str:
    """The keys (those whose name contains `word`, when given) with their defaults and docs, as --help-config
    prints them."""
    rows = [r for r in key_rows(path) if word is None or word.lower() in r[0].lower()]
    if not rows:
        return f"no config key contains {word!r}; train.py --help-config lists them all"
    shown = Path(path).relative_to(REPO_ROOT) if Path(path).is_relative_to(REPO_ROOT) else path
    out = [textwrap.fill(NOTE.format(path=shown), WIDTH), ""]
    for key, default, doc in rows:
        out.append(f"{key} = {default}")
        if doc:
            out.append(textwrap.fill(doc, WIDTH, initial_indent="    ", subsequent_indent="    "))
    return "\n".join(out)
