"""Build hook: pyproject.toml holds the project's metadata; this file only makes the wheel, and
the editable install's wheel, carry ``llcomm_deep_ep_alias.pth`` at the top of site-packages.

Its one line installs ``import deep_ep`` as ``llcomm.deep_ep`` where ``LLCOMM_DEEP_EP_ALIAS=1``
and costs nothing otherwise (llcomm_deep_ep_alias.py; docs/deep_ep.md, "Engines that import
deep_ep"). tests/test_deep_ep_alias.py checks that the installed file is there.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "llcomm_deep_ep_alias.pth"
#: A ``.pth`` line that starts with ``import`` runs at interpreter start: the module is imported
#: only where the variable is set to something other than "0".
PTH_LINE = ('import os; os.environ.get("LLCOMM_DEEP_EP_ALIAS", "0") not in ("", "0") and '
            '__import__("llcomm_deep_ep_alias").install_from_environment()\n')


class BuildPyWithPth(build_py):
    """``build_py``, then the ``.pth`` file beside the top-level packages. An editable build
    (setuptools' ``editable_wheel``) copies nothing from ``build_lib`` into its wheel, which
    holds what the install command's folder holds: the file goes there instead."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            folder = self.get_finalized_command("install").install_lib
        else:
            folder = self.build_lib
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, PTH), "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self, *args, **kwargs):
        outputs = super().get_outputs(*args, **kwargs)
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, PTH))
        return outputs


setup(cmdclass={"build_py": BuildPyWithPth})
