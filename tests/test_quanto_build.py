"""optimum-quanto's extension is built once per machine (`kvdemo.cache.formats.quanto.build`): every other process, of
any kind and with another compiler in its environment, loads that build and runs no compile step.

Cost: about 6 s (one more Python process warming up quanto); up to a minute more where nothing built it before."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvdemo.cache.formats.quanto.build import build_key, share_quanto_build
from kvdemo.cache.warmup import warm_up

pytest.importorskip("optimum.quanto")  # a pinned requirement: present wherever the set-up ran

NO_COMPILE = """
import optimum.quanto.library.extensions.extension as extension
def refuse(*args, **kwargs):
    raise RuntimeError("quanto's extension was compiled again")
extension.load = refuse  # torch.utils.cpp_extension.load: the compile step
from kvdemo.cache.warmup import warm_up
warm_up(("quanto",))
print(extension.get_extension("quanto_cpp")._lib.__file__)
"""


@pytest.mark.process  # starts a Python process of its own (13 s): `make test-fast` skips it, `make test` runs it
def test_a_second_process_loads_the_one_build_and_compiles_nothing(tmp_path):
    warm_up(("quanto",))  # this process: built by the set-up (or now, the first time on this machine)
    folder = share_quanto_build()["quanto_cpp"]
    library = folder / "quanto_cpp.so"
    built = library.stat().st_mtime_ns
    # another kind of process: another working folder, another compiler named, the same kvdemo cache folder
    env = {**os.environ, "CXX": "g++", "PYTHONPATH": os.getcwd()}
    run = subprocess.run(
        [sys.executable, "-c", NO_COMPILE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == str(library)
    assert library.stat().st_mtime_ns == built  # not rebuilt
    assert folder.name == build_key("quanto_cpp", *_sources_and_flags())


def _sources_and_flags() -> tuple[list[str], list[str] | None]:
    from optimum.quanto.library.extensions.extension import get_extension  # type: ignore[import-untyped]

    ext = get_extension("quanto_cpp")
    return ext.sources, ext.extra_cflags
