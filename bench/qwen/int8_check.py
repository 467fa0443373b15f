"""Validation alpha-hat of the float head and of its int8 copy on the recipe's held-back split
(the training run's own validation, under its autocast), from the repository root:

    python bench/qwen/int8_check.py outputs/eagle3_qwen_coder/draft
    python bench/qwen/int8_check.py outputs/eagle3_qwen_coder_3k/draft data.num_conversations=3000

(overrides after the package name go to the recipe, so another run's data config reads its own
feature cache).
"""
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from draftsmith.heads.quantize import quantize, record
from draftsmith.train.distill import DistillRecipe

pkg, extra = sys.argv[1], sys.argv[2:]
with initialize_config_dir(config_dir=str(Path("conf").resolve()), version_base="1.3"):
    cfg = compose("distill", overrides=["experiment=eagle3_qwen_coder", "name=int8val",
                                        "out_dir=/tmp/int8val", f"draft.init_from={pkg}",
                                        "train.resume=false", "train.eval_batches=64",
                                        "logging=none", *extra])
recipe = DistillRecipe(cfg)
recipe.setup()
float_val = recipe.validate()
module = recipe.accelerator.unwrap_model(recipe.draft.module)
names = record(module, "int8", ("fc",))["modules"]  # what scripts/quantize.py quantizes
quantize(module, "int8", names)
int8_val = recipe.validate()
out = {"float": float_val, "int8": int8_val, "modules": len(names),
       "diff": [a - b for a, b in zip(float_val["alpha_hat"], int8_val["alpha_hat"])]}
print(json.dumps(out, indent=1))
Path("bench/qwen/int8_check.json").write_text(json.dumps(out, indent=1))
