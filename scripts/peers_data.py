"""The peers' offline training formats, written from draftsmith's feature cache (``make peers``).

Every trainer reads the same sequences: the token ids and loss masks of draftsmith's split and
the hidden states the target gave for them (the fused layers and the final-norm state the
cache holds). Each writer takes the sequences as :class:`Sequence` records (:func:`sequences`)
and writes one trainer's files; the writers import nothing of the peers' packages.

* **speculators** (0.9.0, offline): an Arrow dataset (``save_to_disk``, torch format) with
  ``input_ids``, ``loss_mask`` and ``seq_len`` per row, and ``hidden_states/hs_{i}.safetensors``
  with ``hidden_states (T, k + 1, H)`` (the fused layers, then the last plane, which the trainer
  passes through the target's final norm itself) and ``token_ids (T,)``; the draft vocabulary
  as ``d2t.npy`` (offsets) and ``t2d.npy``. Two conversions make it train on exactly what
  draftsmith trains on: the last plane is the cached final-norm state divided by the norm's
  weight (an RMS-1 vector the trainer's norm maps back onto it), and the loss mask is shifted
  one position left, because its trainer counts a position by the mask of the token it reads
  where draftsmith counts it by the mask of the token after the one it predicts
  (``heads/eagle_ttt.py``). The validation rows follow the training rows, and the trainer's
  ``train_data_ratio`` splits them there.
* **ModelOpt** (0.47.0, offline): one ``data_{i}.pt`` per row, ``{input_ids, loss_mask,
  hidden_states (T, H) after the final norm, aux_hidden_states (T, k*H)}``; its loss counts a
  position by the mask of the token it reads, as speculators' does, so the mask is shifted the
  same way.
* **SpecForge** (0.2.0, offline): one ``.ckpt`` per row, ``{input_ids (T,), loss_mask (T,),
  hidden_state (1, T, H) after the final norm (bf16), aux_hidden_state (1, T, k*H)}``. Its first TTT
  step counts the entry at ``j`` (fused features of ``j``, token ``j + 1``, teacher ``p_{j+1}``,
  predicting token ``j + 2``) by ``loss_mask[j]``, the mask of the position it reads, where
  draftsmith counts it by the mask of the token it predicts: the mask is shifted two positions
  left (``m'[j] = m[j + 2]``); its later steps shift it one more position each, as
  draftsmith's ``teacher_mask`` does.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from draftsmith.scripts.tooling import note, repo_path

SPECULATORS_HS = "hidden_states"  # speculators' FileTransfer folder under the data path


@dataclass(frozen=True)
class Row:
    """One sequence of the split: ``input_ids (T,)``, ``loss_mask (T,) bool`` (draftsmith's:
    the tokens to learn to predict), ``fused (T, k*H)`` in the head's fuse order and
    ``final (T, H)``, the target's final-norm hidden state."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    fused: torch.Tensor
    final: torch.Tensor


def sequences(dataset: Sequence, fuse_layers: Sequence[int]) -> Iterable[Row]:
    """The rows of a feature dataset (``data.feature_data.FeatureDataset`` items with
    ``hidden`` and ``layers``; its ``layers`` attribute names the cached ids)."""
    ids = list(dataset.layers)
    missing = [i for i in fuse_layers if i not in ids]
    if missing:
        raise ValueError(f"fused layers {missing} are not in the feature cache (layers {ids})")
    for k in range(len(dataset)):
        item = dataset[k]
        if "hidden" not in item:
            raise ValueError("the peers read the final hidden state from the cache: build it "
                             "with data.features=offline")
        fused = torch.cat([item["layers"][ids.index(i)] for i in fuse_layers], dim=-1)
        yield Row(item["input_ids"].long(), item["loss_mask"].bool(), fused, item["hidden"])


def shift_mask_for_speculators(loss_mask: torch.Tensor) -> torch.Tensor:
    """The mask speculators (and ModelOpt) need to count the positions draftsmith counts:
    ``m'[j] = m[j + 1]`` (0 at the end)."""
    return shift_mask(loss_mask, 1)


def shift_mask(loss_mask: torch.Tensor, by: int) -> torch.Tensor:
    """``m'[j] = m[j + by]`` (0 past the end) for a (T,) mask."""
    out = torch.zeros_like(loss_mask)
    if by < len(loss_mask):
        out[:len(loss_mask) - by] = loss_mask[by:]
    return out


def unnormed_final(final: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """A vector that the target's RMS norm (weight ``norm_weight``) maps onto ``final``, up to
    its epsilon: ``final / weight`` has RMS 1 (the normed state over its scale)."""
    w = norm_weight.float()
    if bool((w.abs() < 1e-6).any()):
        raise ValueError("the target's final norm has zero weights: its normed state cannot be "
                         "handed to a trainer that applies the norm itself")
    return final.float() / w


def write_speculators(out: Path, train: Iterable[Row], val: Iterable[Row],
                      norm_weight: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                      dtype: torch.dtype = torch.bfloat16) -> dict:
    """speculators' offline data (see the module docstring): the dataset and its hidden states
    in ``out/data`` (``--data-path``), the vocabulary map beside it. Returns ``{"data_path",
    "rows", "train_rows", "train_lengths", "train_masked", "train_data_ratio", "mean_length",
    "max_length", "d2t_path", "t2d_path"}`` (per training row: its tokens, its loss-masked
    positions)."""
    import shutil

    from datasets import Dataset

    data, staged = out / "data", out / SPECULATORS_HS
    for folder in (data, staged):
        if folder.exists():
            shutil.rmtree(folder)
    staged.mkdir(parents=True)
    cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    n_train = 0
    for split, rows in (("train", train), ("val", val)):
        for row in rows:
            i = len(cols["seq_len"])
            planes = torch.cat([row.fused.float(), unnormed_final(row.final, norm_weight)], -1)
            h = row.final.shape[-1]
            save_file({"hidden_states": planes.view(len(row.input_ids), -1, h).to(dtype)
                       .contiguous(), "token_ids": row.input_ids.long().contiguous()},
                      str(staged / f"hs_{i}.safetensors"))
            cols["input_ids"].append(row.input_ids.tolist())
            cols["loss_mask"].append(shift_mask_for_speculators(row.loss_mask).long().tolist())
            cols["seq_len"].append(len(row.input_ids))
            n_train += split == "train"
    if n_train == 0 or n_train == len(cols["seq_len"]):
        raise ValueError("speculators needs training and validation rows")
    ds = Dataset.from_dict(cols)
    ds.set_format(type="torch")
    ds.save_to_disk(str(data))  # the dataset at the data path, its hidden states beside
    staged.rename(data / SPECULATORS_HS)
    d2t_path, t2d_path = out / "d2t.npy", out / "t2d.npy"
    np.save(d2t_path, (d2t.long() - torch.arange(d2t.numel())).numpy())
    np.save(t2d_path, t2d.bool().numpy())
    lengths = cols["seq_len"][:n_train]
    masked = [int(sum(m)) for m in cols["loss_mask"][:n_train]]
    return {"data_path": str(data), "rows": len(cols["seq_len"]), "train_rows": n_train,
            "train_lengths": lengths, "train_masked": masked,
            "train_data_ratio": n_train / len(cols["seq_len"]),
            "train_tokens": int(sum(lengths)), "mean_length": float(np.mean(lengths)),
            "max_length": int(max(lengths)), "d2t_path": str(d2t_path),
            "t2d_path": str(t2d_path)}


def write_modelopt(out: Path, rows: Iterable[Row]) -> int:
    """ModelOpt's offline rows (``data_{i}.pt``, see the module docstring); returns how many."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for n, row in enumerate(rows, start=1):
        torch.save({"input_ids": row.input_ids.long(),
                    "loss_mask": shift_mask_for_speculators(row.loss_mask).long(),
                    "hidden_states": row.final.contiguous(),
                    "aux_hidden_states": row.fused.contiguous()}, out / f"data_{n - 1}.pt")
    return n


def write_specforge(out: Path, rows: Iterable[Row], dtype: torch.dtype = torch.bfloat16) -> int:
    """SpecForge's offline rows (``data_{i}.ckpt``, see the module docstring: the loss mask
    shifted two positions left); returns how many. The final state is stored in bf16, the dtype
    of SpecForge's target head (``TargetHead.from_pretrained`` casts it to bf16, and its linear
    takes no other input dtype), the fused layers in ``dtype``, the draft's."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for n, row in enumerate(rows, start=1):
        torch.save({"input_ids": row.input_ids.long(),
                    "loss_mask": shift_mask(row.loss_mask, 2).long(),
                    "hidden_state": row.final[None].to(torch.bfloat16).contiguous(),
                    "aux_hidden_state": row.fused[None].to(dtype).contiguous()},
                   out / f"data_{n - 1}.ckpt")
    return n


# ----------------------------------------------------------------------------- shared by the runs
def vocab_map(prep: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft vocabulary draftsmith's head takes (``heads.eagle.build_eagle``): the most
    frequent loss-masked ids of the training split plus the EOS ids."""
    from draftsmith.data.feature_data import FeatureDataset
    from draftsmith.heads.vocab import build_vocab_map

    model = prep["loaded"].model
    counts = FeatureDataset(prep["train_dir"]).token_counts(int(model.config.vocab_size))
    eos = model.config.eos_token_id
    return build_vocab_map(counts, prep["draft_vocab_size"],
                           [eos] if isinstance(eos, int) else list(eos or []))


def peer_python(engine: str, engines_dir: str) -> tuple[Path | None, str | None]:
    """The Python of a peer's environment (``scripts/engine_envs.py``, made on first use), or
    None and why it could not be made."""
    from draftsmith.scripts.engine_envs import ensure_env

    try:
        return ensure_env(engine, repo_path(engines_dir)), None
    except Exception as e:  # noqa: BLE001 (recorded: the comparison goes on without it)
        return None, f"environment: {str(e)[-1500:]}"


def run_trainer(name: str, cmd: list[str], log: Path, timeout_s: float, threads: int,
                env: dict[str, str] | None = None) -> tuple[int, float, float]:
    """Run a trainer's command with ``threads`` threads; (exit code, wall s, peak RSS MiB)."""
    from draftsmith.scripts.bench_train import run_with_peak_rss

    note("peers", f"{name}: {' '.join(cmd[:3])} ... (log {log})")
    threads_env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                   "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return run_with_peak_rss(cmd, log, timeout_s, env=threads_env)


def log_tail(log: Path, lines: int = 12) -> str:
    """The last ``lines`` lines of a log ("" when there is none)."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.is_file() \
        else ""
