"""mkdocs hooks (``hooks:`` in mkdocs.yml): generated parts of the docs site.

- ``docs/performance.md``: the marker ``<!-- perf-tables -->`` becomes the tables of every
  ``bench/results/*.json`` (``tools/perf_table.py``), so the page always shows the result files.
- The plots next to them (``bench/results/*.png``) are added to the site under ``bench/``.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File

MARKER = "<!-- perf-tables -->"
IMAGE_DIR = "bench"


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _perf_table(root: Path):
    spec = importlib.util.spec_from_file_location("llcomm_perf_table", root / "tools" / "perf_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def on_files(files, config):
    for png in sorted((_root(config) / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"{IMAGE_DIR}/{png.name}", abs_src_path=str(png)))
    return files


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    root = _root(config)
    results = sorted((root / "bench" / "results").glob("*.json"))
    if not results:
        raise ValueError(f"{page.file.src_uri}: {MARKER} but no bench/results/*.json")
    # Links are relative to the page's source file; mkdocs rewrites them for the site.
    up = "../" * page.file.src_uri.count("/")
    tables = _perf_table(root).results_markdown(results, image_dir=f"{up}{IMAGE_DIR}")
    return markdown.replace(MARKER, tables)
