"""Validation alpha-hat of the float head and of its int8 copy on the recipe's held-back split
(the training run's own validation, under its autocast), from the repository root:

    python bench/qwen/int8_check.py outputs/eagle3_qwen_coder/draft bench/qwen/int8_check.json
    python bench/qwen/int8_check.py outputs/eagle3_qwen_coder_3k/draft \
        bench/qwen/release3k/int8_check.json data.num_conversations=3000 train.eval_batches=16

(overrides after the output file go to the recipe, so another run's data config reads its own
feature cache). The first check used 64 validation micro-batches; the 3k head's used 16, the
training run's own number, and took 25 minutes for both passes on the 2-core AMX CPU.
"""
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from draftsmith.heads.quantize import quantize, record
from draftsmith.train.distill import DistillRecipe

pkg, out_file, extra = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
defaults = {"experiment": "eagle3_qwen_coder", "name": "int8val", "out_dir": "/tmp/int8val",
            "draft.init_from": pkg, "train.resume": "false", "train.eval_batches": "64",
            "logging": "none"}
defaults.update(item.split("=", 1) for item in extra)
with initialize_config_dir(config_dir=str(Path("conf").resolve()), version_base="1.3"):
    cfg = compose("distill", overrides=[f"{k}={v}" for k, v in defaults.items()])
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
out_file.write_text(json.dumps(out, indent=1))
