"""What the data commands say: no advice against tpurun's own output, a CSV given to inspect
pointed at data write, a packed row id warned about, and one time for one write."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from tpurun.cli.app import app
from tpurun.data.advice import advise
from tpurun.data.inspect import FileInfo, inspect
from tpurun.data.write import write_dataset
from tpurun.errors import DataError


def write_csv(path, rows: int = 120, id_name: str = "id") -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    lines = [f"{id_name},a,b,c,target"]
    lines += [
        f"{i + 100},{r[0]:.4f},{r[1]:.4f},{r[2]:.4f},{int(r.sum() > 0)}" for i, r in enumerate(x)
    ]
    path.write_text("\n".join(lines) + "\n")


def test_no_shard_advice_for_what_data_write_itself_writes():
    files = [FileInfo(f"d/tab-{split}-{i:05d}-of-00008.tfrecord", 4000, 57)
             for split in ("train", "validation") for i in range(8)]  # fmt: skip
    assert advise(files, "none", []) == []
    # The same 16 small files not written as two sets of 8: too many for their size.
    loose = [FileInfo(f"d/part-{i}.tfrecord", 4000, 57) for i in range(16)]
    assert any("too many small files" in line for line in advise(loose, "none", []))


def test_inspect_of_a_csv_names_the_command_that_makes_tfrecords(tmp_path):
    write_csv(tmp_path / "train.csv")
    with pytest.raises(DataError) as info:
        inspect([str(tmp_path / "train.csv")])
    assert str(info.value) == (
        f"{tmp_path / 'train.csv'} is a CSV file, not TFRecords (the tf.train.Example records "
        f"tpurun reads). Write it as TFRecords: `tpurun data write {tmp_path / 'train.csv'} "
        "OUT_PREFIX`, then give OUT_PREFIX-*.tfrecord in its place."
    )


@pytest.mark.parametrize(
    ("id_name", "why"),
    [("id", "its name"), ("patient", "its values are distinct integers, each above the last")],
)
def test_packing_every_column_warns_of_a_row_id(tmp_path, id_name, why):
    write_csv(tmp_path / "t.csv", id_name=id_name)
    report = write_dataset(str(tmp_path / "t.csv"), str(tmp_path / "out" / "t"), label="target",
                           pack=["x"])  # fmt: skip
    assert report.warnings == [
        f"--pack x: column '{id_name}' looks like a row id ({why}), and it is packed into x, "
        "where the model learns from it. To leave it out: --pack x=a:c"
    ]
    named = write_dataset(str(tmp_path / "t.csv"), str(tmp_path / "out2" / "t"), label="target",
                          pack=["x=a:c"])  # fmt: skip
    assert named.warnings == []  # columns named: the user chose


def test_a_write_says_its_time_once(tmp_path):
    write_csv(tmp_path / "t.csv")
    result = CliRunner().invoke(app, ["data", "write", str(tmp_path / "t.csv"),
                                      str(tmp_path / "out" / "t"), "--plain"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.count("records/s") == 1 and " in " not in result.output.split("wrote")[0]


@pytest.mark.parametrize(
    ("asked", "meant"),
    [("bc.yml", "bc.yaml"), ("bcc.yaml", "bc.yaml"), ("other.yaml", None)],
)
def test_a_missing_config_suggests_the_file_meant(tmp_path, monkeypatch, asked, meant):
    from tpurun.config import load_config
    from tpurun.errors import ConfigError

    (tmp_path / "bc.yaml").write_text("name: bc\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(asked)
    hint = f"; did you mean {meant}?" if meant else ""
    assert info.value.problems == [f"{asked}: no such file{hint}"]
