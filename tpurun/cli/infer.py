"""``tpurun evaluate|predict|export``: the commands that open a finished run, kept apart from
:mod:`tpurun.cli.app` (which registers them) so each file stays short. Same rules: parse, call one
library function, hand the result to :mod:`tpurun.display.reports`, exit codes through
:mod:`tpurun.cli.boundary`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from tpurun.cli.boundary import exit_codes

RunArg = Annotated[
    str, typer.Argument(help="A run directory that `tpurun train` made.", show_default=False)
]
CheckpointOpt = Annotated[
    str,
    typer.Option(
        "--checkpoint",
        metavar="best|latest|PATH",
        help="best: checkpoints/best.keras (a LoRA run's best.adapter.h5, a model-parallel "
        "run's best.orbax), else the final model.keras (model.lora.h5); latest: the resume "
        "point; or a .keras / .weights.h5 / .adapter.h5 / .lora.h5 file or an .orbax folder.",
    ),
]


def evaluate(
    run_dir: RunArg,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            metavar="GLOB",
            help="Records to score (default: the config's validation set).",
        ),
    ] = None,
    checkpoint: CheckpointOpt = "best",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Score a split, every record exactly once; writes eval-<name>.json into RUN_DIR."""
    with exit_codes():
        from tpurun.display import reports
        from tpurun.infer.evaluate import evaluate as run_evaluate

        reports.show_evaluation(run_evaluate(run_dir, data, checkpoint), as_json=as_json)


def predict(
    run_dir: RunArg,
    data: Annotated[
        str,
        typer.Option("--data", metavar="GLOB", help="Records to predict (targets may be absent)."),
    ],
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="A .csv (id and one column per output, or class and probabilities), .npy or "
            ".npz; a causal LM's completions: .csv or .jsonl (id, prompt, completion).",
        ),
    ],
    id_feature: Annotated[
        str | None,
        typer.Option("--id-feature", metavar="NAME", help="A feature written as the first column."),
    ] = None,
    checkpoint: CheckpointOpt = "best",
    max_length: Annotated[
        int | None,
        typer.Option(
            "--max-length",
            metavar="N",
            help="A causal LM's whole sequence in tokens, prompt included, as KerasHub's "
            "generate(max_length) (default: the run's model.sequence_length).",
        ),
    ] = None,
    sampler: Annotated[
        str,
        typer.Option(
            "--sampler",
            metavar="greedy|top_k",
            help="How a causal LM picks each token: the likeliest (greedy), or drawn from the "
            "K likeliest (top_k, with --top-k K).",
        ),
    ] = "greedy",
    top_k: Annotated[
        int | None,
        typer.Option("--top-k", metavar="K", help="With --sampler top_k: the tokens drawn from."),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed",
            metavar="S",
            help="With --sampler top_k: the draws' seed (default: the run's seed).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Predict every record once, in file order (sorted file names, then record order); on a
    causal LM, complete every prompt."""
    with exit_codes():
        from tpurun.display import reports
        from tpurun.infer.predict import predict as run_predict

        result = run_predict(
            run_dir,
            data,
            output,
            id_feature=id_feature,
            checkpoint=checkpoint,
            max_length=max_length,
            sampler=sampler,
            top_k=top_k,
            seed=seed,
        )
        reports.show_predicted(result, as_json=as_json)


def export(
    run_dir: RunArg,
    format: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            metavar="keras|saved_model|onnx|lora|huggingface",
            help="The artifact; lora: a LoRA fine-tune's adapter alone (KerasHub's .lora.h5); "
            "huggingface: a causal LM's folder for transformers and vLLM, LoRA merged.",
        ),
    ],
    output: Annotated[
        str,
        typer.Option(
            "--output",
            "-o",
            metavar="PATH",
            help="The artifact's path (model.keras, a SavedModel folder, model.onnx, "
            "adapter.lora.h5, a Hugging Face folder); its description goes beside it as "
            "PATH.json.",
        ),
    ],
    checkpoint: CheckpointOpt = "best",
    platforms: Annotated[
        str,
        typer.Option(
            "--platforms",
            metavar="LIST",
            help="Where a JAX model's SavedModel runs: cpu, cuda, rocm, tpu (cpu included).",
        ),
    ] = "cpu,cuda",
    check_python: Annotated[
        str | None,
        typer.Option(
            "--check-python",
            metavar="PYTHON",
            help="huggingface: the Python whose transformers and torch check the folder "
            "(default: this one, where it has them; else the folder is written unchecked).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Export a model that loads without tpurun, checked in a fresh process before it is kept."""
    with exit_codes():
        from tpurun.display import reports
        from tpurun.infer.export import export as run_export

        result = run_export(
            run_dir,
            format,
            output,
            checkpoint=checkpoint,
            platforms=platforms,
            check_python=check_python,
        )
        reports.show_exported(result, as_json=as_json)
