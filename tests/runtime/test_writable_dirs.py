"""Where the runtime writes (quire/writable_dirs.py): the cache from QUIRE_CACHE_DIR,
XDG_CACHE_HOME or HOME, and a folder of the process's own where none of those can be written
(issue 36). Unwritable folders are made by putting them under a plain file: that stops root too,
as a read-only filesystem would."""

from __future__ import annotations

import logging
import os

import pytest

from quire import writable_dirs


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """No probe results or process folder carried over; no developer settings."""
    monkeypatch.setattr(writable_dirs, "_writable", set())
    monkeypatch.setattr(writable_dirs, "_warned", set())
    monkeypatch.setattr(writable_dirs, "_process_folder", None)
    for var in ("QUIRE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def unwritable(tmp_path) -> str:
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "folder")


def test_the_cache_follows_xdg_cache_home_then_home(monkeypatch, tmp_path):
    assert writable_dirs.cache_root() == str(tmp_path / "home" / ".cache" / "quire")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert writable_dirs.cache_root() == str(tmp_path / "xdg" / "quire")
    assert writable_dirs.kernel_cache_dir() == str(tmp_path / "xdg" / "quire" / "kernels")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # invalid by the XDG spec: ignored
    assert writable_dirs.cache_root() == str(tmp_path / "home" / ".cache" / "quire")
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "explicit"))  # wins over both
    assert writable_dirs.cache_root() == str(tmp_path / "explicit")


def test_an_unwritable_cache_gives_one_warning_and_a_folder_of_the_process(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", unwritable(tmp_path))
    with caplog.at_level(logging.WARNING, logger="quire.writable_dirs"):
        root = writable_dirs.cache_root()
        assert writable_dirs.cache_root() == root and writable_dirs.kernel_cache_dir().startswith(root)
    (warning,) = caplog.records
    assert "a-file/folder/quire" in warning.message and "$XDG_CACHE_HOME" in warning.message
    assert "QUIRE_CACHE_DIR" in warning.message  # what to set
    assert os.path.isdir(os.path.dirname(root)) and "a-file" not in root
    probe = os.path.join(root, "probe")
    os.makedirs(root, exist_ok=True)
    open(probe, "w").close()  # it is writable


def test_the_cache_turned_off_still_gives_the_kernels_a_folder(monkeypatch):
    monkeypatch.setenv("QUIRE_CACHE_DIR", "")
    assert writable_dirs.cache_root() is None
    kernels = writable_dirs.kernel_cache_dir()
    assert kernels == writable_dirs.kernel_cache_dir() and not kernels.startswith(os.environ["HOME"])


def test_the_loader_and_the_kernels_share_the_cache(monkeypatch, tmp_path):
    from quire.models.loader import cache_root
    from quire.native import loader
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == str(tmp_path / "xdg" / "quire")
    assert loader._cache_dir() == os.path.join(cache_root(), "kernels")
