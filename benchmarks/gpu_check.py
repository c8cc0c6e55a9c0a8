"""The Python half of benchmarks/gpu_check.sh: what it installs, the Gemma inputs, the final table.

The shell script drives; each subcommand here is one of its steps, run by the interpreter under
test (``PYTHON``) with the carried wheels on ``PYTHONPATH``:

    gpu_check.py missing WHEELS            names of the carried distributions not installed here
    gpu_check.py environment WORK          versions and jax.devices(), printed and kept as JSON
    gpu_check.py gemma WORK SCALE PEAK     a Gemma preset with random weights, token records, a config
    gpu_check.py report WORK [OUT]         the table of every run; OUT/gpu_check.json

The Gemma model is built from its config, since no weights can be downloaded there: at ``full``
scale Gemma 2B's decoder (18 layers, hidden 2048, 8 query heads and 1 key/value head of 256, an
FFN of 2 x 16384) with the 256-piece SentencePiece vocabulary of tests/hub_presets.py instead of
Gemma's 256,000 (which would add 0.5B parameters of embedding and a 256,000-wide softmax): 1.98B
parameters. Its records are token ids written directly (``tpurun data write --tokenize`` runs the
tokenizer through tf.data, and the GPU machine has no TensorFlow): every sequence an arithmetic
progression over the vocabulary, which a causal LM can learn.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEAK_NOTE = "H100 SXM dense bfloat16"
RUNS = ("quickstart", "naic_like", "gemma_lora")
VERSIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "keras", "keras-hub",
            "tpurun", "numpy", "protobuf", "pydantic", "tensorboardX", "sentencepiece")  # fmt: skip

#: The Gemma fine-tune at each scale. ``full`` fits one H100 in about 4 minutes (build, save, load,
#: compile, 120 steps); ``tiny`` rehearses the same steps on a CPU in a few seconds.
GEMMA_2B_DECODER = {"num_layers": 18, "num_query_heads": 8, "num_key_value_heads": 1,
                    "hidden_dim": 2048, "intermediate_dim": 32768, "head_dim": 256}  # fmt: skip
SCALES = {
    "full": {"sizes": GEMMA_2B_DECODER, "sequence_length": 1024, "batch": 8, "epochs": 3,
             "steps": 40, "validation_records": 64, "lora_rank": 8},
    "tiny": {"sizes": {}, "sequence_length": 32, "batch": 8, "epochs": 3, "steps": 8,
             "validation_records": 32, "lora_rank": 4},
}  # fmt: skip
#: Environment variables that change the full scale's Gemma run (a rerun that must fit).
OVERRIDES = {"GPU_CHECK_GEMMA_LAYERS": ("sizes", "num_layers"),
             "GPU_CHECK_GEMMA_SEQUENCE": ("sequence_length", None),
             "GPU_CHECK_GEMMA_BATCH": ("batch", None),
             "GPU_CHECK_GEMMA_STEPS": ("steps", None)}  # fmt: skip
FIRST_ID = 4  # ids 0-3 are <pad>, <eos>, <bos>, <unk>
BOS = 2


def canonical(name: str) -> str:
    """A distribution's name as PyPI compares them (``Typing_Extensions`` -> typing-extensions)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution(wheel: str | Path) -> str:
    """A wheel file's distribution name (``keras_hub-0.32.0-py3-none-any.whl`` -> keras-hub)."""
    return canonical(Path(wheel).name.split("-")[0])


def missing(wheels: str) -> None:
    """Print the carried distributions to install here, one a line: those this interpreter lacks,
    and those whose version here does not meet what a wheel to be installed requires (pydantic
    needs a newer typing-extensions than some images have); each reason on stderr. tpurun is left
    out: the script installs it from the checkout.
    """
    carried = {distribution(w): w for w in Path(wheels).glob("*.whl")}
    install = {name for name in carried if name != "tpurun" and version(name) is None}
    for name in sorted(install):
        print(f"  {name}: not installed", file=sys.stderr)
    while True:
        wanted = [r for w in {"tpurun", *install} if w in carried
                  for r in requirements(carried[w])]  # fmt: skip
        older = {}
        for req in wanted:
            name = canonical(req.name)
            have = version(name)
            if name in carried and name not in install and have is not None:
                if not req.specifier.contains(have, prereleases=True):
                    older[name] = f"{have} here, {req} wanted"
        if not older:
            break
        for name, why in sorted(older.items()):
            print(f"  {name}: {why}", file=sys.stderr)
        install |= set(older)
    print("\n".join(sorted(install)))


def requirements(wheel: Path) -> list:
    """A wheel's ``Requires-Dist`` that apply without extras, as ``packaging`` requirements."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(name).decode().splitlines()
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.partition(":")[2].strip())
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                found.append(req)
    return found


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment(work: str) -> None:
    """Print the versions and devices; keep them in WORK/environment.json for the report."""
    import jax

    devices = jax.devices()
    found = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "versions": {name: version(name) for name in VERSIONS if version(name)},
        "tensorflow": version("tensorflow") or version("tensorflow-cpu"),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
    }
    print(f"python {found['python']} ({sys.executable})")
    print("  ".join(f"{k} {v}" for k, v in found["versions"].items()))
    print(f"tensorflow: {found['tensorflow'] or 'not installed'}")
    print(f"jax.devices(): {devices}")
    Path(work, "environment.json").write_text(json.dumps(found, indent=2))


# ------------------------------------------------------------------------------- the Gemma run
def gemma_scale(scale: str) -> dict:
    chosen = json.loads(json.dumps(SCALES[scale]))
    for variable, (key, inner) in OVERRIDES.items():
        if os.environ.get(variable):
            if inner:
                chosen[key][inner] = int(os.environ[variable])
            else:
                chosen[key] = int(os.environ[variable])
    return chosen


def gemma(work: str, scale: str, peak: str) -> None:
    """Build the preset, write the token records and the run's config into WORK/gemma."""
    import time

    os.environ.setdefault("KERAS_BACKEND", "jax")
    from tpurun import frameworks

    folder = Path(work, "gemma")
    s = gemma_scale(scale)
    frameworks.activated("jax")
    frameworks.keras().config.set_dtype_policy("bfloat16")  # saved as the run will hold them
    started = time.monotonic()
    preset, vocabulary = build_preset(folder, s["sizes"])
    size = sum(f.stat().st_size for f in preset.iterdir())
    print(f"preset: {preset} ({size / 2**30:.2f} GiB, built and saved in "
          f"{time.monotonic() - started:.0f}s)")  # fmt: skip
    features = write_records(folder / "data", s, vocabulary)
    config = {
        "name": "gemma_lora",
        "seed": 0,
        "model": {"preset": str(preset), "lora": {"rank": s["lora_rank"]},
                  "sequence_length": s["sequence_length"]},
        "data": {"train": str(folder / "data" / "tok-train-*.tfrecord"),
                 "validation": str(folder / "data" / "tok-validation-*.tfrecord"),
                 "features": features},
        "train": {"per_core_batch_size": s["batch"], "epochs": s["epochs"],
                  "steps_per_epoch": s["steps"],
                  "learning_rate": {"base": 1e-3, "base_batch_size": None}},
        "runtime": {"precision": "bfloat16", "peak_tflops": float(peak)},
    }  # fmt: skip
    path = folder / "gemma_lora.yaml"
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    print(f"config: {path}")


def build_preset(folder: Path, sizes: dict) -> tuple[Path, int]:
    """A GemmaCausalLM preset of ``sizes`` (tests/hub_presets.py's tiny Gemma where left out),
    with the tiny preset's tokenizer and random weights, at ``folder/preset``; and the size of its
    vocabulary.

    The tied embedding is drawn with a standard deviation of 1 / hidden: drawn as KerasHub draws
    it, each input's own embedding dominates the last hidden state at Gemma 2B's width, so the
    untrained model predicts every token to repeat itself (a loss of 124 on these records, where
    the uniform guess is ln 256 = 5.5). Smaller, the model starts at the uniform guess.
    """
    sys.path.insert(0, str(ROOT / "tests"))
    import hub_presets

    from tpurun import frameworks

    keras, keras_hub = frameworks.keras(), frameworks.keras_hub()
    tiny = hub_presets.gemma(folder / "tiny_preset")  # its SentencePiece vocabulary; seeds 0
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor.from_preset(str(tiny))
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=preprocessor.tokenizer.vocabulary_size(),
        **{**hub_presets.GEMMA_SIZES, **sizes},
    )
    embeddings = backbone.token_embedding.embeddings
    embeddings.assign(keras.random.normal(embeddings.shape, stddev=1 / backbone.hidden_dim,
                                          dtype=embeddings.dtype, seed=0))  # fmt: skip
    print(
        f"Gemma: {backbone.count_params():,} parameters, "
        + ", ".join(f"{k} {v}" for k, v in {**hub_presets.GEMMA_SIZES, **sizes}.items())
    )
    task = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor)
    task.save_to_preset(str(folder / "preset"))
    return folder / "preset", preprocessor.tokenizer.vocabulary_size()


def write_records(folder: Path, s: dict, vocabulary: int) -> dict:
    """Causal LM records as ``tpurun data write --tokenize`` lays them out (``token_ids``,
    ``padding_mask``, ``weights``, N + 1 each), and the features that declare them."""
    import numpy as np

    from tpurun.data.write import write_shards

    n = s["sequence_length"] + 1
    rng = np.random.default_rng(0)

    def records(count: int):
        positions = np.arange(n - 1)
        for _ in range(count):
            start, step = rng.integers(0, vocabulary - FIRST_ID, 2)
            ids = FIRST_ID + (start + (step | 1) * positions) % (vocabulary - FIRST_ID)
            yield {"token_ids": np.concatenate([[BOS], ids]).astype(np.int64),
                   "padding_mask": np.ones(n, np.int64),
                   "weights": np.concatenate([[0], np.ones(n - 1, np.int64)])}  # fmt: skip

    folder.mkdir(parents=True, exist_ok=True)
    train = s["batch"] * s["steps"]
    write_shards(str(folder / "tok-train"), records(train), 4)
    write_shards(str(folder / "tok-validation"), records(s["validation_records"]), 1)
    print(f"records: {train} train, {s['validation_records']} validation, {n} tokens each")
    return {
        "token_ids": {"type": "int64", "shape": [n], "cast": "int32"},
        "padding_mask": {"type": "int64", "shape": [n], "cast": "bool"},
        "weights": {"type": "int64", "shape": [n], "cast": "float32"},
    }


# ------------------------------------------------------------------------------------ the report
def read_steps(work: Path) -> dict[str, dict]:
    """WORK/steps.tsv: one line a step (name, exit code, seconds, bound), written by the script."""
    steps = {}
    path = work / "steps.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, code, seconds, bound = line.split("\t")
        steps[name] = {"exit": int(code), "seconds": int(seconds), "bound": int(bound)}
    return steps


def run_figures(work: Path, name: str) -> dict | None:
    """What a run's summary.json says: status, epochs, throughput (steady epochs), final loss."""
    path = work / "runs" / name / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    throughput = summary.get("throughput") or {}
    return {
        "status": summary.get("status"),
        "accelerator": summary.get("accelerator"),
        "replicas": summary.get("replicas"),
        "precision": summary.get("precision"),
        "global_batch_size": summary.get("global_batch_size"),
        "epochs_completed": summary.get("epochs_completed"),
        "steps_per_epoch": summary.get("steps_per_epoch"),
        "steps_per_execution": summary.get("steps_per_execution"),
        "examples_per_sec": summary.get("examples_per_sec"),
        "tokens_per_sec": throughput.get("tokens_per_second"),
        "tflops_per_device": throughput.get("tflops_per_device"),
        "mfu": throughput.get("mfu"),
        "peak_tflops": throughput.get("peak_tflops"),
        "flops_per_step_per_device": throughput.get("flops_per_step_per_device"),
        "time_to_first_step": summary.get("time_to_first_step"),
        "epoch_seconds": summary.get("epoch_seconds"),
        "input_wait": summary.get("input_wait"),
        "final_metrics": summary.get("final_metrics"),
    }


def _cell(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def report(work: str, out: str | None = None) -> int:
    """Print the final table; write OUT/gpu_check.json. Returns 1 when any run failed."""
    work_path = Path(work)
    steps = read_steps(work_path)
    env_path = work_path / "environment.json"
    env = json.loads(env_path.read_text()) if env_path.exists() else {}
    runs = {name: run_figures(work_path, name) for name in RUNS}
    print(f"\ntpurun on {env.get('device_kind', '?')} ({len(env.get('devices', []))} device(s)), "
          f"scale {os.environ.get('GPU_CHECK_SCALE', 'full')}; steady epochs (the first, "
          "which compiles, left out); MFU against runtime.peak_tflops\n")  # fmt: skip
    header = (f"{'run':12s}{'exit':>5s}{'wall s':>8s}{'epochs':>8s}{'examples/s':>12s}"
              f"{'tokens/s':>12s}{'TFLOP/s/dev':>13s}{'MFU':>8s}{'loss':>9s}")  # fmt: skip
    print(header)
    print("-" * len(header))
    failed = False
    for name in RUNS:
        step, fig = steps.get(name, {}), runs[name] or {}
        code = step.get("exit")
        failed |= code != 0
        loss = (fig.get("final_metrics") or {}).get("loss")
        print(f"{name:12s}{_cell(code, 'd'):>5s}{_cell(step.get('seconds'), 'd'):>8s}"
              f"{_cell(fig.get('epochs_completed'), 'd'):>8s}"
              f"{_cell(fig.get('examples_per_sec'), ',.0f'):>12s}"
              f"{_cell(fig.get('tokens_per_sec'), ',.0f'):>12s}"
              f"{_cell(fig.get('tflops_per_device'), '.3g'):>13s}"
              f"{_cell(fig.get('mfu'), '.1%'):>8s}{_cell(loss, '.4f'):>9s}")  # fmt: skip
    total = steps.get("total", {}).get("seconds")
    budget = steps.get("total", {}).get("bound")
    print(f"\n{total} s in all (budget {budget} s); every step: {work}/<step>.log")
    result = {"scale": os.environ.get("GPU_CHECK_SCALE", "full"), "seconds": total,
              "budget_seconds": budget, "environment": env, "steps": steps, "runs": runs}  # fmt: skip
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "gpu_check.json").write_text(json.dumps(result, indent=2))
        print(f"written: {Path(out, 'gpu_check.json')}")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    commands = {"missing": missing, "environment": environment, "gemma": gemma, "report": report}
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](*argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
