"""ModelOpt's own EAGLE-3 training on a CPU; run inside the modelopt environment.

    <engines>/modelopt/bin/python scripts/engine_runners/modelopt_train.py JOB.json STATS.json

ModelOpt 0.47.0 trains EAGLE-3 with its own model code (``modelopt.torch.speculative``:
``mtsp.convert(model, [("eagle", config)])`` turns the target into an ``HFEagleModel`` whose
``forward`` unrolls the TTT steps and returns its loss) inside Hugging Face's ``Trainer``; its
example script (``examples/speculative_decoding/main.py``) is not in the wheel, so this file
does what that script does, with nothing of ModelOpt's changed:

* the target loaded from its folder, converted with ``eagle_offline=True`` (its decoder layers
  dropped; the base model's outputs come from the data), ``eagle_use_torch_compile=False``;
  ``eagle_architecture_config`` shaped like the target (its default is Llama-3-8B's layer);
* the draft vocabulary map loaded with ``HFEagleModel.load_draft_vocab_cache``;
* offline rows (``data_{i}.pt``: ``input_ids``, ``loss_mask``, ``hidden_states`` after the
  final norm, ``aux_hidden_states``), right-padded to the longest row (ModelOpt's collator pads
  to one fixed length, and its model caches its attention masks for it), passed as
  ``base_model_outputs``;
* ``TrainingArguments`` from JOB.json (``use_cpu``, no saving, no reports), then
  ``model.get_exporter().export(out)``: the EAGLE-3 export ModelOpt writes for engines.

STATS.json: ``trained_tokens`` (the loss-masked positions of the first TTT step, as ModelOpt's
loss counts them), ``train_loop_s`` (``Trainer.train``'s wall time), ``steps``, ``version``.
This file imports only modelopt, transformers and torch.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main(job_path: str, stats_path: str) -> None:
    from importlib.metadata import version

    import modelopt.torch.speculative as mtsp
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(int(job["threads"]))
    torch.manual_seed(int(job["seed"]))
    model = AutoModelForCausalLM.from_pretrained(job["target"], dtype=torch.float32)
    mtsp.convert(model, [("eagle", job["eagle"])])
    type(model).load_draft_vocab_cache(model, job["d2t_path"])
    files = sorted(Path(job["data"]).glob("data_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    rows = [torch.load(p) for p in files]
    stats = {"trained_tokens": 0, "train_loop_s": 0.0, "steps": 0,
             "version": version("nvidia-modelopt")}

    # every batch padded to one length, as ModelOpt's own data collator pads to its
    # training_seq_len: its model caches the TTT attention masks of its first batch
    # (HFEagleModel._get_ttt_attention_mask) and a longer batch after it fails ("The size of
    # tensor a (674) must match the size of tensor b (640)")
    n = max(len(r["input_ids"]) for r in rows)

    def collate(batch: list[dict]) -> dict:

        def pad(key: str, fill: float = 0) -> torch.Tensor:
            out = []
            for r in batch:
                x = r[key]
                shape = (n - len(x), *x.shape[1:])
                out.append(torch.cat([x, torch.full(shape, fill, dtype=x.dtype)]))
            return torch.stack(out)

        mask = pad("loss_mask")
        stats["trained_tokens"] += int(mask[:, 1:].sum())  # the first TTT step's positions
        attn = torch.stack([torch.arange(n) < len(r["input_ids"]) for r in batch]).long()
        return {"input_ids": pad("input_ids"), "attention_mask": attn, "loss_mask": mask,
                "base_model_outputs": {"base_model_hidden_states": pad("hidden_states"),
                                       "aux_hidden_states": pad("aux_hidden_states")}}

    args = TrainingArguments(**job["training"])
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        stats["train_loop_s"] = time.perf_counter() - t0
        stats["steps"] = int(trainer.state.global_step)
        Path(stats_path).write_text(json.dumps(stats))
    model.eval()
    model.get_exporter().export(job["export"])


if __name__ == "__main__":
    main(*sys.argv[1:3])
