"""llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py`), so the tests read GGUF files
written by the ecosystem's tool rather than by our code. It ships in the llama-cpp-python
sdist on the package index (the same one benchmarks' llama.cpp anchor builds from): fetched
once with pip into the user cache, only its Python parts kept."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile

VERSION = "0.3.36"


def converter_dir() -> str:
    root = os.path.join(os.path.expanduser("~"), ".cache", "quire", "test-tools",
                        f"llama.cpp-{VERSION}")
    if os.path.exists(os.path.join(root, ".complete")):
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", tmp],
                       check=True)
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(os.path.join(tmp, f"llama_cpp_python-{VERSION}.tar.gz")) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(keep)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(root, members=members, filter="data")
    open(os.path.join(root, ".complete"), "w").close()
    return root


def convert(hf_folder: str, out_file: str, outtype: str = "f32") -> str:
    root = converter_dir()
    env = {**os.environ, "PYTHONPATH": os.path.join(root, "gguf-py")}
    subprocess.run([sys.executable, os.path.join(root, "convert_hf_to_gguf.py"), hf_folder,
                    "--outfile", out_file, "--outtype", outtype], check=True, env=env,
                   capture_output=True)
    return out_file
