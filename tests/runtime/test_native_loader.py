"""The native kernels' builder and loader (quire.native.loader): a damaged cached build is
rebuilt, the build cache lives where QUIRE_CACHE_DIR says, and a kernel outside its folder
builds with the headers the kernels share; processes that build one source at once compile
it once."""

from __future__ import annotations

import ctypes
import glob
import os

from quire.native import loader

ONE_LINE_SOURCE = 'extern "C" int quire_test_answer() { return 42; }\n'


def test_a_cached_build_that_does_not_load_is_built_again(tmp_path):
    """A kernel library cut short in the cache (a partial copy of a shared cache, a full
    disk) is rebuilt once, with a warning, instead of sending every run to the torch path.
    Both loads run in processes of their own: dlopen would hand this one the library it has
    mapped already, and truncating a library a process has mapped kills it (SIGBUS)."""
    import subprocess
    import sys
    source = tmp_path / "small_kernel.cpp"  # any source: a kernel's own takes seconds to build
    source.write_text(ONE_LINE_SOURCE)
    probe = ("import logging, sys; logging.basicConfig(level=logging.WARNING); "
             "from quire.native import loader; "
             f"sys.exit(loader.load_library({str(source)!r}) is None)")

    def load():
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env={**os.environ, "QUIRE_CACHE_DIR": str(tmp_path)}, timeout=120)

    first = load()
    assert first.returncode == 0 and "does not load" not in first.stderr, first.stderr[-2000:]
    (built,) = glob.glob(str(tmp_path / "kernels" / "small_kernel-*.so"))
    whole = os.path.getsize(built)
    with open(built, "r+b") as f:
        f.truncate(100)
    again = load()
    assert again.returncode == 0 and "does not load" in again.stderr, again.stderr[-2000:]
    assert os.path.getsize(built) == whole


def test_quire_cache_dir_means_the_same_to_the_kernel_and_the_loader(monkeypatch, tmp_path):
    from quire.models.loader import cache_root
    home = os.path.expanduser("~")
    monkeypatch.delenv("QUIRE_CACHE_DIR", raising=False)
    assert loader._cache_dir().startswith(cache_root()) and cache_root().startswith(home)
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path))
    assert loader._cache_dir().startswith(cache_root()) and cache_root() == str(tmp_path)
    monkeypatch.setenv("QUIRE_CACHE_DIR", "")  # off: nothing persistent, anywhere
    assert cache_root() is None
    uncached = loader._cache_dir()
    assert not uncached.startswith(home) and uncached == loader._cache_dir()


SHARED_HEADER_USER = """
#include <cstdint>
#include "bf16.h"
extern "C" float quire_test_round_trip(float x) {
  return quire_bf16::bf16_to_float(quire_bf16::float_to_bf16(x));
}
"""


def test_a_kernel_in_another_folder_builds_with_the_shared_headers_once_per_source(
        monkeypatch, tmp_path):
    """a kernel source outside quire/native may include its
    bf16.h; the cache keys on the source, not on where it lies, so copies of one source (a
    shared cache, Quire installed elsewhere) make one build."""
    monkeypatch.setenv("QUIRE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("QUIRE_CPU_KERNELS", raising=False)
    libraries = []
    for folder in ("one", "two"):
        (tmp_path / folder).mkdir()
        source = tmp_path / folder / "round_trip.cpp"
        source.write_text(SHARED_HEADER_USER)
        lib = loader.load_library(str(source))
        assert lib is not None, "a source outside quire/native that includes bf16.h must build"
        fn = lib.quire_test_round_trip
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
        libraries.append(fn)
    assert [fn(1.0 + 2 ** -10) for fn in libraries] == [1.0, 1.0]  # rounded to bfloat16
    assert len(glob.glob(str(tmp_path / "cache" / "kernels" / "round_trip-*.so"))) == 1


def test_quire_cpu_isa_builds_every_kernel_for_that_isa():
    """$QUIRE_CPU_ISA picks one of the builds this CPU runs for every kernel (the benchmarks
    compare them): the kernel then reports that build's path, as when a test asks for it by
    name; a build the CPU does not run is a ValueError naming those it does. The probes share
    the suite's kernel cache (the kernel tests build every ISA there anyway): a fresh cache
    would compile quant_matmul.cpp twice more for nothing this test checks."""
    import subprocess
    import sys

    import pytest

    from quire.native import quant_matmul
    with pytest.raises(ValueError, match="QUIRE_CPU_ISA='vax'.*this CPU runs the builds"):
        loader._forced_isa("vax")
    probe = "from quire.native import quant_matmul; print(quant_matmul.isa())"
    for build in loader.isa_builds()[:2]:  # the oldest two (scalar, avx2 on x86)
        env = {**os.environ, "QUIRE_CPU_ISA": build}
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == quant_matmul.isa(build)


def test_processes_that_build_one_source_at_once_compile_it_once(tmp_path):
    """Two processes load a source neither has built (the suite's workers, or a node's pods on
    a shared cache, on a cold cache): one compiles, the other waits for its library. The two
    meet at a barrier before they load (their imports take seconds, and unevenly on a busy
    host), and the compiler is a wrapper that logs each call and takes a second, so without
    the lock both would compile beside each other."""
    import subprocess
    import sys
    import textwrap
    source = tmp_path / "slow_build.cpp"
    source.write_text(ONE_LINE_SOURCE)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    calls = tmp_path / "calls.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        case "$*" in *--version*) exec g++ "$@";; esac
        echo "$$" >> {calls}
        sleep 1
        exec g++ "$@"
        """))
    wrapper.chmod(0o755)
    probe = textwrap.dedent(f"""\
        import os, sys, time
        from quire.native import loader
        open(os.path.join({str(barrier)!r}, str(os.getpid())), "w").close()
        while len(os.listdir({str(barrier)!r})) < 2:
            time.sleep(0.01)
        lib = loader.load_library({str(source)!r})
        sys.exit(0 if lib is not None and lib.quire_test_answer() == 42 else 1)
        """)
    env = {**os.environ, "QUIRE_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(wrapper)}
    env.pop("QUIRE_CPU_KERNELS", None)
    procs = [subprocess.Popen([sys.executable, "-c", probe], env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert len(calls.read_text().split()) == 1, "the source was compiled more than once"
    assert len(glob.glob(str(tmp_path / "cache" / "kernels" / "slow_build-*.so"))) == 1
