"""The benchmarks' `--plot` helper writes real PNG files (the figures a README shows)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import plotting  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_line_panels_write_a_png(tmp_path):
    out = tmp_path / "sub" / "serve.png"
    plotting.line_panels(str(out), "t", "concurrent requests",
                         [("tok/s", {"Quire": ([1, 2, 4], [10.0, 19.0, 35.0]),
                                     "llama-server": ([1, 2, 4], [8.0, 12.0, 15.0])})],
                         caption="a machine", log_x=True)
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_grouped_bars_write_a_png(tmp_path):
    out = tmp_path / "memory.png"
    plotting.grouped_bars(str(out), "t", "MiB", ["none", "int8"],
                          {"idle": [900.0, 600.0], "peak": [1000.0, 700.0]})
    assert out.read_bytes()[:8] == PNG_MAGIC and out.stat().st_size > 1000


def test_plot_flag_defaults_to_the_plots_folder():
    import argparse
    ap = argparse.ArgumentParser()
    plotting.add_plot_flag(ap, "serve")
    assert ap.parse_args([]).plot is None
    assert ap.parse_args(["--plot"]).plot == str(Path(plotting.PLOTS) / "serve.png")
    assert ap.parse_args(["--plot", "x.png"]).plot == "x.png"


@pytest.mark.parametrize("script", ["serve", "throughput", "prefix_cache", "single_stream",
                                    "memory", "llamacpp_compare", "cold_start",
                                    "prefill_attention"])
def test_each_benchmark_offers_plot(script):
    assert "add_plot_flag(" in (Path(plotting.PLOTS).parent / f"{script}.py").read_text()
