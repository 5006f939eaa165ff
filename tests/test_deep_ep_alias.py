"""``LLCOMM_DEEP_EP_ALIAS=1``: ``import deep_ep`` gives ``llcomm.deep_ep`` in every process.

Each case starts a fresh interpreter of this environment (the alias is made at interpreter
start, by the ``llcomm_deep_ep_alias.pth`` file the install put in site-packages), from an
empty folder so that nothing but the install is on its path. The file must be installed:
a checkout installed before the file existed fails here, loudly, until it is reinstalled
(scripts/venv.sh, or ``pip install -e .``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import llcomm_deep_ep_alias as hook
from llcomm.runtime import settings as S

ENV = "LLCOMM_DEEP_EP_ALIAS"


def _run(code: str, cwd, alias: str | None = None, pythonpath: str | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "PYTHONPATH")}
    if alias is not None:
        env[ENV] = alias
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def _fake_deep_ep(root) -> str:
    """A package named deep_ep (a stand-in for DeepEP) under ``root``; its folder."""
    pkg = root / "fake" / "deep_ep"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("FAKE = True\n")
    return str(root / "fake")


def test_the_pth_file_is_installed():
    """Fails (never skips) where the install lacks the file: every other case here would then
    test nothing."""
    paths = hook.pth_paths()
    assert paths, (f"{hook.PTH} is in none of this interpreter's site-packages folders; "
                   "reinstall llcomm (scripts/venv.sh, or pip install -e .)")
    line = open(paths[0], encoding="utf-8").read()
    assert line.startswith("import ") and "install_from_environment()" in line, line
    assert ENV in line


def test_on_deep_ep_is_llcomm_deep_ep(tmp_path):
    out = _run("""
        import importlib.util, sys
        # the .pth line ran: the finder is first, and neither llcomm nor torch was imported
        assert type(sys.meta_path[0]).__name__ == "DeepEPAlias", sys.meta_path
        assert "torch" not in sys.modules and "llcomm" not in sys.modules
        spec = importlib.util.find_spec("deep_ep")
        assert spec is not None and spec.name == "deep_ep"
        assert "torch" not in sys.modules           # asking imports nothing
        import deep_ep
        from deep_ep import Buffer, Config
        from deep_ep.utils import EventHandle, EventOverlap
        import deep_ep.utils.event, deep_ep.buffer
        import llcomm.deep_ep
        assert deep_ep is llcomm.deep_ep and sys.modules["deep_ep"] is llcomm.deep_ep
        assert Buffer is llcomm.deep_ep.Buffer and Config is llcomm.deep_ep.Config
        assert deep_ep.Buffer is llcomm.deep_ep.buffer.Buffer
        assert EventOverlap is llcomm.deep_ep.EventOverlap
        assert EventHandle is llcomm.deep_ep.EventHandle
        assert deep_ep.utils is llcomm.deep_ep.utils
        assert sys.modules["deep_ep.utils.event"] is llcomm.deep_ep.utils.event
        assert deep_ep.__name__ == "llcomm.deep_ep"         # llcomm's own module, not a copy
        assert importlib.util.find_spec("deep_ep.utils") is not None
        for missing in ("deep_ep.no_such_module", "deep_ep_cpp"):
            try:
                __import__(missing)
            except ModuleNotFoundError:
                pass
            else:
                raise AssertionError(missing)
        assert llcomm.deep_ep.alias_active()
        print("ok")
        """, tmp_path, alias="1")
    assert out.stdout.strip() == "ok"
    assert "shadowed" not in out.stderr     # no DeepEP installed here: nothing to warn about


@pytest.mark.parametrize("value", [None, "0", ""])
def test_off_deep_ep_is_not_aliased(tmp_path, value):
    _run("""
        import importlib.util, sys
        assert "llcomm_deep_ep_alias" not in sys.modules      # the .pth line imported nothing
        assert importlib.util.find_spec("deep_ep") is None, importlib.util.find_spec("deep_ep")
        try:
            import deep_ep
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError(deep_ep)
        """, tmp_path, alias=value)


def test_a_bad_value_is_said_and_not_aliased(tmp_path):
    p = _run("""
        import importlib.util
        assert importlib.util.find_spec("deep_ep") is None
        """, tmp_path, alias="yes")
    assert f"{ENV}='yes': expected 0 or 1" in p.stderr, p.stderr
    with pytest.raises(ValueError, match=f"{ENV}='yes'"):
        S.value(ENV, {ENV: "yes"})


def test_the_hook_and_the_settings_module_read_the_same_values():
    for raw in (None, "", "0", "1", "2", "yes", "on", " 1"):
        ours = hook.parse(raw)
        try:
            declared = S.value(ENV, {} if raw is None else {ENV: raw})
        except ValueError:
            declared = None
        assert ours == (None if declared is None else bool(declared)), raw


def test_the_setting_wins_over_an_installed_deep_ep(tmp_path):
    fake = _fake_deep_ep(tmp_path)
    p = _run("""
        import warnings
        warnings.simplefilter("always")
        import deep_ep, llcomm.deep_ep
        assert deep_ep is llcomm.deep_ep and not hasattr(deep_ep, "FAKE")
        import deep_ep                          # the warning comes once per process
        print("ok")
        """, tmp_path, alias="1", pythonpath=fake)
    assert p.stdout.strip() == "ok"
    assert p.stderr.count("is shadowed") == 1, p.stderr
    assert os.path.join(fake, "deep_ep") in p.stderr and f"unset {ENV}" in p.stderr, p.stderr
    # without the setting, the installed one is imported
    _run("""
        import deep_ep
        assert deep_ep.FAKE
        """, tmp_path, alias="0", pythonpath=fake)


SPAWN_SCRIPT = """
import multiprocessing as mp
import os
import sys


def child(q):
    import deep_ep
    import llcomm.deep_ep
    from deep_ep.utils import EventOverlap
    q.put((deep_ep.Buffer is llcomm.deep_ep.Buffer and EventOverlap is llcomm.deep_ep.EventOverlap,
           os.environ.get("LLCOMM_DEEP_EP_ALIAS")))


if __name__ == "__main__":
    if sys.argv[1] == "code":
        import llcomm.deep_ep
        assert os.environ.get("LLCOMM_DEEP_EP_ALIAS") is None
        llcomm.deep_ep.install_alias()
        import deep_ep
        assert deep_ep is llcomm.deep_ep
    ctx = mp.get_context(sys.argv[2])
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    got = q.get(timeout=240)
    p.join(60)
    assert p.exitcode == 0, p.exitcode
    print(got)
"""


@pytest.mark.parametrize("how", ["environment", "code"])
def test_a_spawned_child_inherits_the_alias(tmp_path, how):
    script = tmp_path / "spawn_check.py"
    script.write_text(SPAWN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "PYTHONPATH")}
    if how == "environment":
        env[ENV] = "1"
    p = subprocess.run([sys.executable, str(script), how, "spawn"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == "(True, '1')", p.stdout + p.stderr


def test_install_alias_from_code_and_remove_it(tmp_path):
    fake = _fake_deep_ep(tmp_path)
    _run("""
        import importlib.util, os, sys
        import llcomm.deep_ep
        assert not llcomm.deep_ep.alias_active()
        llcomm.deep_ep.install_alias(inherit=False)
        llcomm.deep_ep.install_alias(inherit=False)             # once is enough: idempotent
        assert [type(f).__name__ for f in sys.meta_path].count("DeepEPAlias") == 1
        assert "LLCOMM_DEEP_EP_ALIAS" not in os.environ
        import deep_ep
        assert deep_ep is llcomm.deep_ep
        assert llcomm.deep_ep.remove_alias() and not llcomm.deep_ep.remove_alias()
        assert "deep_ep" not in sys.modules and "llcomm.deep_ep" in sys.modules
        import deep_ep                                          # the installed one again
        assert deep_ep.FAKE
        try:
            llcomm.deep_ep.install_alias()
        except RuntimeError as e:
            assert "already imported" in str(e) and "install the alias before" in str(e), e
        else:
            raise AssertionError("install_alias over an imported deep_ep")
        """, tmp_path, pythonpath=fake)


def test_describe_says_what_deep_ep_resolves_to(tmp_path):
    fake = _fake_deep_ep(tmp_path)
    p = _run("""
        import llcomm_deep_ep_alias as hook
        print(hook.describe())
        """, tmp_path, alias="1", pythonpath=fake)
    line = p.stdout.strip()
    assert line.startswith(f"deep_ep alias ({ENV}=1): active: import deep_ep gives "
                           "llcomm.deep_ep (the DeepEP package at "), line
    p = _run("""
        import llcomm_deep_ep_alias as hook
        print(hook.describe())
        """, tmp_path)
    assert p.stdout.strip() == (f"deep_ep alias ({ENV}=unset): not active: import deep_ep "
                                "gives nothing (no DeepEP installed)"), p.stdout


def test_llcomm_doctor_prints_the_alias_line(tmp_path):
    p = _run("""
        from llcomm.commands import doctor
        print(doctor.alias_line())
        """, tmp_path, alias="1")
    assert p.stdout.strip() == (f"deep_ep alias ({ENV}=1): active: import deep_ep gives "
                                "llcomm.deep_ep"), p.stdout
    p = _run("""
        from llcomm.commands import doctor
        print(doctor.alias_line())
        """, tmp_path, alias="on")
    assert p.stdout.strip().endswith(f"({ENV}='on': expected 0 or 1)"), p.stdout
