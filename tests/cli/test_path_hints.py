"""A glob that matches nothing says which rule read it: a config's paths from the config file's
folder, a command line's from the working directory."""

from __future__ import annotations

import pytest

from tpurun.data.files import PathRule, expand, working_directory
from tpurun.errors import DataError


def test_a_command_line_glob_names_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        expand("data/test-*.tfrecord", key="--data")
    assert str(info.value) == (
        f"--data: {tmp_path}/data/test-*.tfrecord: no file matches this glob. 'data/test-*.tfrecord'"
        f" is relative: it is read from the working directory, {tmp_path}."
    )
    assert working_directory() == PathRule(str(tmp_path), "the working directory")


def test_a_config_glob_names_the_config_files_folder(tmp_path):
    from tpurun.config import load_config
    from tpurun.data.resolve import path_resolver

    (tmp_path / "exp").mkdir()
    config_file = tmp_path / "exp" / "c.yaml"
    config_file.write_text(
        "model: {factory: m.py:build, loss: mse}\n"
        "data: {train: data/train-*.tfrecord, inputs: x, targets: y}\n"
    )
    rule = path_resolver(load_config(str(config_file)))
    with pytest.raises(DataError, match=r"is relative: it is read from the config file's folder, "
                       + str(tmp_path / "exp")):  # fmt: skip
        expand("data/train-*.tfrecord", rule, "data.train")


def test_an_absolute_glob_gets_no_hint(tmp_path):
    with pytest.raises(DataError) as info:
        expand(str(tmp_path / "nothing-*"))
    assert "relative" not in str(info.value)
