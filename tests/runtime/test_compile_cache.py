"""JAX's persistent compilation cache (runtime.compilation_cache): a rerun loads what the first run
compiled, trains to the same figures, and an unusable folder is refused or passed over."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import TPURUN, cli_env, read_summary, toy_config, write_config

from tpurun.errors import EnvironmentSetupError
from tpurun.runtime import compile_cache


# ----------------------------------------------------------------------------- the folder chosen
def test_auto_is_jax_own_variable_else_under_tpuruns_cache(tmp_path, monkeypatch):
    named = str(tmp_path / "from-jax")
    assert compile_cache.resolve("auto", {"JAX_COMPILATION_CACHE_DIR": named}) == (named, None)
    assert Path(named).is_dir()
    monkeypatch.setenv("TPURUN_CACHE_DIR", str(tmp_path / "tpurun"))
    assert compile_cache.resolve("auto", {}) == (str(tmp_path / "tpurun" / "jax"), None)
    assert compile_cache.resolve(False, {"JAX_COMPILATION_CACHE_DIR": named}) == (None, None)


def test_a_named_folder_is_made_and_one_that_cannot_be_is_refused(tmp_path):
    made = tmp_path / "a" / "b"
    assert compile_cache.resolve(str(made), {}) == (str(made), None)
    assert made.is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(EnvironmentSetupError) as caught:
        compile_cache.resolve(str(tmp_path / "file"), {})
    assert str(caught.value) == (
        f"runtime.compilation_cache: cannot use '{tmp_path / 'file'}' (a file of that name is in "
        "the way). Name a folder this user can write, set it to auto, or to false to compile "
        "afresh each time."
    )
    with pytest.raises(EnvironmentSetupError, match="'gs://b/cache' is not a local folder"):
        compile_cache.resolve("gs://b/cache", {})


def test_an_unusable_auto_folder_is_passed_over_with_a_warning(tmp_path):
    (tmp_path / "file").write_text("x")
    folder = str(tmp_path / "file" / "jax")
    assert compile_cache.resolve("auto", {"JAX_COMPILATION_CACHE_DIR": folder}) == (
        None,
        f"the compilation cache is off: cannot use {folder} (Not a directory)",
    )


def test_each_install_takes_effect_in_the_same_process_as_a_notebooks_next_run(tmp_path):
    """JAX settles on its cache at its first compile; a kernel's next run names another folder,
    or none, and gets it."""
    import jax
    import jax.numpy as jnp

    first, second = tmp_path / "first", tmp_path / "second"
    x = jnp.arange(3.0)  # made before: each folder below gets one program, the function's
    try:
        compile_cache.install(str(first))
        jax.jit(lambda x: x * 3 + 1)(x)
        assert compile_cache.use.as_dict() == {"folder": str(first), "loaded": 0, "compiled": 1}
        compile_cache.install(str(second))
        jax.jit(lambda x: x * 5 - 2)(x)
        compile_cache.install(None)
        jax.jit(lambda x: x * 7)(x)
        assert compile_cache.use.as_dict() == {"folder": None, "loaded": 0, "compiled": 0}
    finally:  # the suite's own folder (conftest.py) for the tests after this one
        compile_cache.install(os.environ["JAX_COMPILATION_CACHE_DIR"])
    assert len(list(first.glob("*-cache"))) == 1
    assert len(list(second.glob("*-cache"))) == 1


# ------------------------------------------------------------------------------------ real runs
def _train(config: Path, out: Path, cache_root: Path, *sets: str):
    """`tpurun train` with tpurun's own choice of folder (the suite's JAX settings removed)."""
    env = cli_env(TPURUN_CACHE_DIR=str(cache_root))
    for key in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        env.pop(key, None)
    args = [TPURUN, "train", str(config), "--output", str(out)]
    for value in sets:
        args += ["--set", value]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)


def _summary(out: Path) -> dict:
    return read_summary(out / "toy")


@pytest.mark.slow
def test_a_rerun_loads_every_program_the_first_run_compiled_and_trains_the_same(toy_data, tmp_path):
    config = write_config(tmp_path, toy_config(toy_data, tmp_path / "unused"))
    cache = tmp_path / "cache"
    first = _train(config, tmp_path / "first", cache)
    assert first.returncode == 0, first.stderr
    compiled = _summary(tmp_path / "first")["compilation_cache"]
    assert compiled["folder"] == str(cache / "jax")
    assert compiled["loaded"] == 0 and compiled["compiled"] > 3  # train, evaluate, predict, ...
    entries = sorted(p.name for p in (cache / "jax").glob("*-cache"))
    assert len(entries) == compiled["compiled"]
    assert "loaded from the compilation cache" not in first.stdout

    again = _train(config, tmp_path / "again", cache)
    assert again.returncode == 0, again.stderr
    assert _summary(tmp_path / "again")["compilation_cache"] == {
        "folder": str(cache / "jax"),
        "loaded": compiled["compiled"],
        "compiled": 0,
    }
    assert "program(s) loaded from the compilation cache)" in again.stdout
    assert sorted(p.name for p in (cache / "jax").glob("*-cache")) == entries

    fresh = _train(config, tmp_path / "fresh", cache, "runtime.compilation_cache=false")
    assert fresh.returncode == 0, fresh.stderr
    assert _summary(tmp_path / "fresh")["compilation_cache"] is None
    # Loaded or compiled, the same programs: the same figures, to the last digit.
    metrics = [_summary(tmp_path / run)["final_metrics"] for run in ("first", "again", "fresh")]
    assert metrics[0] == metrics[1] == metrics[2]
    logs = [(tmp_path / run / "toy" / "log.csv").read_text() for run in ("first", "again", "fresh")]
    assert logs[0] == logs[1] == logs[2]


@pytest.mark.slow
def test_a_named_folder_in_the_way_exits_2_and_an_unusable_default_only_warns(toy_data, tmp_path):
    config = write_config(tmp_path, toy_config(toy_data, tmp_path / "unused"))
    (tmp_path / "file").write_text("x")
    refused = _train(config, tmp_path / "out", tmp_path / "cache",
                     f"runtime.compilation_cache={tmp_path / 'file'}")  # fmt: skip
    assert refused.returncode == 2
    assert "runtime.compilation_cache: cannot use" in refused.stderr
    assert "Traceback" not in refused.stderr + refused.stdout
    assert not (tmp_path / "cache").exists()

    warned = _train(config, tmp_path / "out2", tmp_path / "file")  # TPURUN_CACHE_DIR: a file
    assert warned.returncode == 0, warned.stderr
    assert (
        f"the compilation cache is off: cannot use {tmp_path / 'file' / 'jax'} (Not a directory)"
        in warned.stdout
    )
    assert _summary(tmp_path / "out2")["compilation_cache"] is None
