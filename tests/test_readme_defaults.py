"""One source of truth for what the README recommends: its ``vllm serve`` command configures the
connector and its provider as their defaults do, so an operator who leaves a setting out gets
the recommended behaviour, not a weaker one.

The command block is read from README.md (the one ``tests/test_readme_serve.py`` runs verbatim);
its ``--kv-transfer-config`` JSON is parsed, and every setting it gives the provider, and every
connector setting it gives besides the choice of provider and mode, must equal that setting's
default.
"""

from __future__ import annotations

import json
import re
from typing import Any

from semkv.config import SemkvConfig
from semkv.plugins import get_provider_class
from tests.test_readme_serve import readme_serve_block

# Connector settings an operator must choose: they have no recommended default to agree with.
CHOICES = {"provider", "semantic_mode"}


def readme_extra_config() -> dict[str, Any]:
    block = readme_serve_block()
    found = re.search(r"--kv-transfer-config '(.*?)'", block, re.S)
    assert found, "the README's serve command has no --kv-transfer-config"
    transfer = json.loads(found.group(1))
    extra = transfer["kv_connector_extra_config"]
    assert isinstance(extra, dict)
    return extra


def test_the_readme_gives_the_provider_only_its_defaults() -> None:
    extra = readme_extra_config()
    cls = get_provider_class(extra["provider"])
    given = extra.get("provider_config", {})
    configured = cls.Config.model_validate(given)
    defaults = cls.Config()
    differing = {k for k in given if getattr(configured, k) != getattr(defaults, k)}
    assert not differing, (
        f"README sets {sorted(differing)} of provider {extra['provider']!r} to other than the "
        "default: make the recommended value the default (or recommend the default)")


def test_the_readme_gives_the_connector_only_its_defaults_besides_its_choices() -> None:
    extra = readme_extra_config()
    configured = SemkvConfig.load(extra)
    defaults = SemkvConfig.load({k: v for k, v in extra.items() if k in CHOICES})
    differing = {k for k in extra if k not in CHOICES | {"provider_config"}
                 and getattr(configured, k) != getattr(defaults, k)}
    assert not differing, f"README sets {sorted(differing)} to other than the default"

