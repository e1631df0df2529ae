"""The plugin host, through real entry points (a dist-info folder on sys.path, as pip makes)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PLUGIN = textwrap.dedent(
    """
    import semkv
    from semkv.provider import DonorProvider

    class Echo(DonorProvider):
        name = "echo"
        def register_donor(self, donor): pass
        def lookup(self, query): return []
        def evict(self, donor_id): pass
        def reset(self): pass

    @semkv.hookimpl
    def register_providers(register):
        register(Echo)
    """
)


@pytest.fixture
def third_party(tmp_path):
    (tmp_path / "echo_plugin.py").write_text(PLUGIN)
    info = tmp_path / "semkv_echo-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: semkv-echo\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text("[semkv]\necho = echo_plugin\n")
    return tmp_path


def _run(code, path, **env):
    full = dict(os.environ, PYTHONPATH=str(path), **env)
    full.pop("SEMKV_LOAD_PLUGINS", None) if "SEMKV_LOAD_PLUGINS" not in env else None
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full)


LIST = "import json; from semkv.plugins import providers; print(json.dumps(sorted(providers())))"


def test_third_party_and_builtin_register_the_same_way(third_party):
    out = _run(LIST, third_party)
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert "echo" in names and "chunks" in names


def test_load_plugins_restricts(third_party):
    out = _run(LIST, third_party, SEMKV_LOAD_PLUGINS="semkv-echo")
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["echo"]
    out = _run(LIST, third_party, SEMKV_LOAD_PLUGINS="")
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_unknown_provider_lists_installed(third_party):
    code = "from semkv.plugins import get_provider_class; get_provider_class('nope')"
    out = _run(code, third_party)
    assert out.returncode != 0
    assert "'nope' is not installed" in out.stderr
    assert "chunks" in out.stderr and "echo" in out.stderr


def test_cli_plugins_prints_versions(third_party):
    code = "from semkv.cli import main; main(['plugins'])"
    out = _run(code, third_party)
    rows = {r["provider"]: r for r in json.loads(out.stdout)}
    assert rows["echo"]["distribution"] == "semkv-echo" and rows["echo"]["version"] == "1.2.3"
    assert rows["chunks"]["distribution"] == "semkv-chunks"


def test_register_rejects_non_providers():
    from semkv import plugins

    class NotAProvider:
        name = "bad"

    class Plugin:
        @staticmethod
        @__import__("semkv").hookimpl
        def register_providers(register):
            register(NotAProvider)

    plugins._reset_for_tests()
    try:
        plugins.plugin_manager().register(Plugin(), name="bad-plugin")
        with pytest.raises(TypeError, match="not a semkv DonorProvider"):
            plugins.providers()
    finally:
        plugins._reset_for_tests()


def test_a_broken_plugin_does_not_hide_the_others(tmp_path):
    info = tmp_path / "semkv_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: semkv-broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[semkv]\nbroken = no_such_module_anywhere\n")
    out = _run(LIST, tmp_path)
    assert "chunks" in json.loads(out.stdout.strip().splitlines()[-1])
    code = "from semkv.plugins import get_provider_class; get_provider_class('broken')"
    out = _run(code, tmp_path)
    assert "'broken' failed to load" in out.stderr and "ModuleNotFoundError" in out.stderr


def test_fault_injector_is_listed_as_testing_only_and_refused_without_opt_in(monkeypatch):
    from semkv.plugins import TestingOnlyProviderError, get_provider_class, plugin_versions

    rows = {r["provider"]: r for r in plugin_versions()}
    assert rows["faulty"]["testing_only"] is True
    assert not any(r["testing_only"] for name, r in rows.items() if name != "faulty")
    monkeypatch.delenv("SEMKV_ALLOW_FAULT_INJECTION", raising=False)
    with pytest.raises(TestingOnlyProviderError, match="SEMKV_ALLOW_FAULT_INJECTION=1"):
        get_provider_class("faulty")
    monkeypatch.setenv("SEMKV_ALLOW_FAULT_INJECTION", "1")
    assert get_provider_class("faulty").name == "faulty"
