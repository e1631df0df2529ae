import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semkv.config import ConfigError, SemkvConfig, valid_keys
from semkv.types import Mode


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("SEMKV_"):
            monkeypatch.delenv(name)


def test_safe_defaults_never_materialize():
    config = SemkvConfig.load()
    assert config.semantic_mode in (Mode.DISCOVERY_ONLY, Mode.DISABLED)
    assert config.provider == "chunks"
    assert config.block_aligned_only is True
    assert config.async_lookup is False and config.async_load is False


def test_extra_config_is_read():
    config = SemkvConfig.load({"provider": "minhash", "semantic_mode": "materialize_exact",
                               "donor_store_bytes": "2GiB", "provider_config": {"k": 1}})
    assert config.semantic_mode is Mode.MATERIALIZE_EXACT
    assert config.donor_store_bytes == 2 << 30
    assert config.provider_config == {"k": 1}


def test_env_overrides_extra_config(monkeypatch):
    monkeypatch.setenv("SEMKV_SEMANTIC_MODE", "disabled")
    monkeypatch.setenv("SEMKV_PROVIDER_CONFIG", '{"threshold": 0.5}')
    config = SemkvConfig.load({"semantic_mode": "materialize_exact"})
    assert config.semantic_mode is Mode.DISABLED
    assert config.provider_config == {"threshold": 0.5}


def test_yaml_overrides_extra_config_and_env_overrides_yaml(tmp_path, monkeypatch):
    path = tmp_path / "semkv.yaml"
    path.write_text("min_reuse_tokens: 512\nmin_similarity: 0.7\n")
    config = SemkvConfig.load({"config_file": str(path), "min_reuse_tokens": 64})
    assert config.min_reuse_tokens == 512 and config.min_similarity == 0.7
    monkeypatch.setenv("SEMKV_MIN_REUSE_TOKENS", "256")
    monkeypatch.setenv("SEMKV_CONFIG_FILE", str(path))
    assert SemkvConfig.load().min_reuse_tokens == 256


def test_unknown_key_names_it_and_the_closest():
    with pytest.raises(ConfigError, match=r"'min_similarty'.*did you mean 'min_similarity'"):
        SemkvConfig.load({"min_similarty": 0.5})


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("providr: chunks\n")
    with pytest.raises(ConfigError, match=r"'providr'.*'provider'"):
        SemkvConfig.load({"config_file": str(path)})


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="config_file"):
        SemkvConfig.load({"config_file": str(tmp_path / "nope.yaml")})


def test_unknown_env_var(monkeypatch):
    monkeypatch.setenv("SEMKV_SEMANTIC_MODEL", "x")
    with pytest.raises(ConfigError, match=r"SEMKV_SEMANTIC_MODEL.*semantic_mode"):
        SemkvConfig.load()


@pytest.mark.parametrize(
    "key,value",
    [
        ("semantic_mode", "materialise"),
        ("min_similarity", 1.5),
        ("min_similarity", "high"),
        ("min_reuse_tokens", 0),
        ("lookup_timeout_ms", -1),
        ("max_donors", 0),
        ("donor_store_bytes", "lots"),
        ("provider", ""),
        ("provider_config", "not-a-dict"),
        ("async_load", "maybe"),
    ],
)
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        SemkvConfig.load({key: value})


@settings(max_examples=60, deadline=None)
@given(key=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=24))
def test_any_unknown_key_fails_naming_it(key):
    if key in valid_keys():
        return
    with pytest.raises(ConfigError) as info:
        SemkvConfig.load({key: 1})
    assert repr(key) in str(info.value)


def test_readme_documents_every_config_key():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [k for k in valid_keys() if f"`{k}`" not in readme]
    assert not missing, f"README misses config keys: {missing}"
