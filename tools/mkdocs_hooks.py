"""mkdocs hooks (``hooks:`` in mkdocs.yml): the benchmark plots on the docs site.

The tables of ``docs/performance.md`` are committed in the page (``tools/perf_table.py --write``
renders them from ``bench/results/*.json``; ``tests/test_perf_tables.py`` keeps them current), so
the page reads the same on GitHub and on the site. Its plots are linked as
``../bench/results/<name>.png``, which is right in the repository but outside the docs folder:

- ``on_files`` adds every ``bench/results/*.png`` to the site under ``bench/``;
- ``on_page_markdown`` points those links there.
"""
from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

IMAGE_DIR = "bench"
#: An image link into bench/results from a page in docs/: ``](../bench/results/NAME.png)``.
PLOT_LINK = re.compile(r"\]\((?:\.\./)+bench/results/([\w.-]+\.png)\)")


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def on_files(files, config):
    for png in sorted((_root(config) / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"{IMAGE_DIR}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    # Links are relative to the page's source file; mkdocs rewrites them for the site.
    up = "../" * page.file.src_uri.count("/")
    return PLOT_LINK.sub(lambda m: f"]({up}{IMAGE_DIR}/{m.group(1)})", markdown)
