"""The docs stay true to the code: every config key described, links that resolve, a short README."""

import re

import yaml
from support import REPO


def schema_keys(node, prefix=""):
    for key, spec in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        nested = spec.get("properties")
        if nested:  # a section is described by its keys
            yield from schema_keys(spec, f"{path}.")
        else:
            yield path


def test_every_schema_key_is_described_in_the_config_reference():
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    described = set(re.findall(r"^\| `([^`]+)` \|", (REPO / "config" / "README.md").read_text(), re.M))
    missing = [key for key in schema_keys(schema) if key not in described]
    assert not missing, f"config/README.md does not describe {missing}"
    assert len(described) > 40


def test_relative_links_in_the_docs_resolve():
    pages = [REPO / "README.md", REPO / "config" / "README.md", *(REPO / "docs").glob("*.md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_the_readme_is_a_three_minute_read():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150
