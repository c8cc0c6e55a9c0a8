"""``tpurun data write|inspect|bench``: the ``data`` commands of :mod:`tpurun.cli.app`, kept apart so
each file stays short. Same rules: parse, call one library function, hand the result to
:mod:`tpurun.display.data_reports`, exit codes through :mod:`tpurun.cli.boundary`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from tpurun.cli.args import ConfigArg, SetOpt
from tpurun.cli.boundary import SetCommand, exit_codes, fail
from tpurun.cli.tokenizing import Tokenizing
from tpurun.errors import TpurunError

data_app = typer.Typer(
    name="data",
    help="Write, inspect and benchmark TFRecord datasets.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@data_app.command("bench", cls=SetCommand)
def data_bench(
    config: ConfigArg,
    set_: SetOpt = None,
    steps: Annotated[
        int, typer.Option("--steps", min=1, help="Batches to time after warm-up.")
    ] = 100,
    warmup: Annotated[
        int, typer.Option("--warmup", min=0, help="Batches read before timing.")
    ] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
) -> None:
    """Measure the configured training input pipeline alone: is the input the bottleneck?

    With a model.preset, the preset's preprocessor tokenises the text as training would (on the
    CPU), unless the records were tokenised once (tpurun data write --tokenize)."""
    with exit_codes():
        from tpurun.config import load_config
        from tpurun.display import data_reports

        cfg = load_config(config, set_ or [])
        from tpurun.plan.bench import bench

        preprocessing = lengths = None
        if cfg.model.preset is not None:
            from tpurun.hub.batches import pipeline_preprocessing
            from tpurun.hub.lengths import measurer

            preprocessing = pipeline_preprocessing(cfg)
            lengths = measurer(preprocessing.preprocessor)
        result = bench(
            cfg, steps=steps, warmup=warmup, preprocessing=preprocessing, lengths=lengths
        )
        data_reports.show_bench(result, str(config), as_json=as_json)


@data_app.command("write")
def data_write(
    source: Annotated[
        str,
        typer.Argument(
            help="A .npz or .npy file, a folder of .npy files, CSV files (header row required) "
            "or JSONL files (.jsonl: one JSON object per line), as a path or a quoted glob, or an "
            "image folder with one subfolder per class.",
            show_default=False,
        ),
    ],
    out_prefix: Annotated[
        str,
        typer.Argument(
            help="Shards are OUT_PREFIX[-train|-validation]-00000-of-00008.tfrecord, plus "
            "OUT_PREFIX.schema.json. Local, gs:// or ram://.",
            show_default=False,
        ),
    ],
    shard_mb: Annotated[
        float, typer.Option("--shard-mb", min=0.001, help="Target shard size in MB.")
    ] = 150.0,
    shard_multiple: Annotated[
        int,
        typer.Option(
            "--shard-multiple",
            min=1,
            help="Shard count is a multiple of this (cores x hosts reading it).",
        ),
    ] = 8,
    compression: Annotated[str, typer.Option("--compression", help="none | gzip")] = "none",
    validation_fraction: Annotated[
        float,
        typer.Option(
            "--validation-fraction",
            min=0.0,
            max=0.99,
            help="Fraction written as a validation split.",
        ),
    ] = 0.0,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the validation draw and image order.")
    ] = 0,
    image_size: Annotated[
        tuple[int, int] | None,
        typer.Option(
            "--image-size", help="Re-encode images to H W (JPEG q95; PNG stays PNG).", metavar="H W"
        ),
    ] = None,
    chunk_records: Annotated[
        int, typer.Option("--chunk-records", min=1, help="Records held in memory at a time.")
    ] = 4096,
    label: Annotated[
        str | None,
        typer.Option(
            "--label",
            help="CSV or JSONL: the label column (key). Text labels become class indices "
            "0..K-1, their names kept in the schema file (class_names).",
            metavar="COL",
        ),
    ] = None,
    pack: Annotated[
        list[str] | None,
        typer.Option(
            "--pack",
            help="CSV: pack numeric columns into one float vector feature: NAME=COL,COL,... or "
            "NAME=FIRST:LAST (a range in column order); NAME alone packs every numeric column "
            "but --label. Repeatable.",
            metavar="NAME[=COLS]",
        ),
    ] = None,
    fill_missing: Annotated[
        str | None,
        typer.Option(
            "--fill-missing",
            help="CSV: write empty (or nan) cells of numeric columns as this number, or as "
            "'mean' (each column's mean). Without it they are an error.",
            metavar="NUMBER|mean",
        ),
    ] = None,
    text: Annotated[
        list[str] | None,
        typer.Option(
            "--text",
            help="CSV or JSONL: store this column as a text feature (one UTF-8 string a record) "
            "even if its values are numbers (zip codes, ids with leading zeros); in JSONL, every "
            "value of it must be a string. Without it, a column whose values are not all numbers "
            "is text, unless it is the --label. Repeatable.",
            metavar="COL",
        ),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option("--overwrite", help="Replace a dataset already written under OUT_PREFIX."),
    ] = False,
    tokenize: Annotated[
        str | None,
        typer.Option(
            "--tokenize",
            help="Write token ids instead of text, tokenised once by this KerasHub preset's "
            "preprocessor (a folder or a kaggle:// or hf:// handle): a causal LM's prompt and "
            "response (or one text), or a classifier's text beside its --label. Train with the "
            "same preset and sequence length.",
            metavar="PRESET",
        ),
    ] = None,
    sequence_length: Annotated[
        int | None,
        typer.Option(
            "--sequence-length",
            min=1,
            help="With --tokenize: the tokens per record (the config's model.sequence_length); "
            "default: the preset's own.",
            metavar="N",
        ),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(
            "--chat-template",
            help="With --tokenize, for chat data: a YAML file of user, assistant (and system) "
            "turn templates, each with one {content}, for a preset whose family has no chat "
            "format (Gemma, Llama 3 and Qwen have theirs).",
            metavar="FILE",
        ),
    ] = None,
    packing: Annotated[
        bool,
        typer.Option(
            "--packing",
            help="With --tokenize, for a causal LM: pack the train split's examples into full "
            "sequences (first-fit, in order); the validation split stays one example a record.",
        ),
    ] = False,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            help="Tokenise as this preset config trains: model.preset, model.sequence_length, "
            "data.packing and data.chat_template from it, in place of --tokenize, "
            "--sequence-length, --packing and --chat-template.",
            metavar="CONFIG",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    plain: Annotated[
        bool, typer.Option("--plain", help="Plain lines instead of a live view.")
    ] = False,
) -> None:
    """Write sharded TFRecords (and a schema file) from arrays, CSV or JSONL files, or an image
    folder."""
    from tpurun.display.lines import TaskProgress
    from tpurun.display.reporter import want_plain

    if compression not in ("none", "gzip"):
        raise fail(TpurunError(f"--compression: expected none or gzip, got {compression!r}."))
    plain = want_plain(plain)
    progress = TaskProgress("writing", "records", plain=plain or as_json, closing=False)
    with exit_codes(interrupted="interrupted: nothing was left half-written"):
        from tpurun.data.write import write_dataset
        from tpurun.display import data_reports

        tokenizing = Tokenizing(tokenize, sequence_length, chat_template, packing, config)
        map_source = tokenizing.mapper()
        with progress:
            report = write_dataset(
                source,
                out_prefix,
                shard_mb=shard_mb,
                shard_multiple=shard_multiple,
                compression=compression,
                validation_fraction=validation_fraction,
                seed=seed,
                image_size=image_size,
                chunk_records=chunk_records,
                progress=progress,
                label=label,
                pack=pack,
                fill_missing=fill_missing,
                overwrite=overwrite,
                text=text,
                map_source=map_source,
            )
        report.warnings.extend(tokenizing.unnamed(report))
        data_reports.show_written(report, source, as_json=as_json, plain=plain)


@data_app.command("inspect")
def data_inspect(
    globs: Annotated[
        list[str],
        typer.Argument(help="TFRecord file glob(s): local, gs:// or ram://.", show_default=False),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
    sample: Annotated[
        int, typer.Option("--sample", min=1, help="Records read to infer features.")
    ] = 16,
    plain: Annotated[
        bool, typer.Option("--plain", help="Plain lines instead of a live view.")
    ] = False,
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset",
            help="Also show the text's lengths in tokens for this preset (a folder or handle), "
            "from a sample of up to 512 records, and what --sequence-length cuts.",
            metavar="PRESET",
        ),
    ] = None,
    sequence_length: Annotated[
        int | None,
        typer.Option(
            "--sequence-length",
            min=1,
            help="With --preset: the model.sequence_length to check (default: the preset's).",
        ),
    ] = None,
) -> None:
    """List files, bytes and records, infer the features, and print a ready-to-paste features: block."""
    from tpurun.display.lines import TaskProgress
    from tpurun.display.reporter import want_plain

    plain = want_plain(plain)
    progress = TaskProgress("counting records", "files", plain=plain or as_json)
    with exit_codes():
        from tpurun.data.inspect import inspect
        from tpurun.display import data_reports

        if sequence_length is not None and preset is None:
            raise TpurunError(
                "--sequence-length goes with --preset (whose tokenizer counts the tokens): "
                "add --preset PRESET, or leave --sequence-length out."
            )
        with progress:
            report = inspect(globs, sample=sample, progress=progress)
        lengths = None
        if preset is not None:
            from tpurun.hub.lengths import of_inspected

            lengths = of_inspected(preset, sequence_length, report)
        data_reports.show_inspected(
            report, globs, as_json=as_json, plain=plain, token_lengths=lengths
        )
