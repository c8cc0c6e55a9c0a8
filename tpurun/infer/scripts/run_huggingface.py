"""Load a Hugging Face export with transformers, as a user serving it would, and save what it
computes.

``tpurun export --format huggingface`` runs this file by its path in a fresh Python process
(``python -I``), possibly another environment's Python: it imports only torch and transformers,
never tpurun or Keras. Standalone on purpose: keep tpurun imports out of it.

Usage: python -I run_huggingface.py FOLDER CHECK.json OUTPUTS.npz

CHECK.json holds ``prompts`` (texts) and ``token_ids`` (the preset tokenizer's ids of each, start
token first). For each prompt, transformers' tokenizer's ids are reported, and the model's logits
for the preset tokenizer's ids are saved as ``logits_<i>`` (float32, ``[length, vocabulary]``),
so a tokenizer that splits differently is told apart from weights that compute differently. The
last line printed is a JSON object: the ids, the classes loaded, the dtype computed in (float32)
and the versions.
"""

import json
import sys

import numpy as np


def main(folder, check_path, out_path):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(check_path) as f:
        check = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # In float32 whatever the folder holds (16-bit weights upcast exactly): the parent compares
    # with the trained weights computing in float32 too, so a wrong mapping cannot hide in
    # bfloat16's rounding.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    ids, logits = [], {}
    with torch.no_grad():
        for i, (prompt, expected) in enumerate(
            zip(check["prompts"], check["token_ids"], strict=True)
        ):
            ids.append([int(t) for t in tokenizer(prompt)["input_ids"]])
            out = model(torch.tensor([expected], dtype=torch.long)).logits[0]
            logits[f"logits_{i}"] = out.float().numpy()
    np.savez(out_path, **logits)
    print(
        json.dumps(
            {
                "token_ids": ids,
                "model": type(model).__name__,
                "tokenizer": type(tokenizer).__name__,
                "dtype": str(model.dtype).removeprefix("torch."),
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "tpurun_imported": "tpurun" in sys.modules,
            }
        )
    )


if __name__ == "__main__":
    main(*sys.argv[1:4])
