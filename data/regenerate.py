"""Self-distillation data: regenerate the assistant turns of conversations with the target.

Each assistant message is replaced by the target's own reply to the conversation so far (user
turns are kept, earlier assistant turns are the regenerated ones). Results are appended to a jsonl
file, one finished conversation per line, so a killed run restarts where it stopped: finished ids
are skipped, a half-written last line is discarded, nothing is lost or duplicated.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith.data.chat_format import PLAIN_CHAT_TEMPLATE, PLAIN_STOP_STRINGS
from draftsmith.data.regen_reuse import check_same_requests, read_records
from draftsmith.data.sharegpt import Conversation


def _load_done(path: Path) -> dict[str, Conversation]:
    """Finished conversations in a jsonl file; a trailing partial line is cut off the file."""
    if path.exists():
        raw = path.read_bytes()
        good = len(raw[: raw.rfind(b"\n") + 1])
        if good != len(raw):
            with open(path, "r+b") as f:  # a killed writer left half a line
                f.truncate(good)
    return {c.id: c for c in read_records(path)}


def _first_prompt_tokens(messages: Sequence[dict[str, str]], tokenizer: Any) -> int:
    """Token length of the first prompt regeneration answers: the turns up to the first
    assistant turn that follows a user turn (leading assistant turns are dropped, as
    :func:`_regenerate_batch` drops them), through the chat template."""
    prompt: list[dict[str, str]] = []
    for m in messages:
        if m["role"] == "assistant":
            if any(p["role"] == "user" for p in prompt):
                break
            continue  # a leading reply: never part of a prompt
        prompt.append(m)
    if not any(p["role"] == "user" for p in prompt):
        return 0
    return len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])


@torch.no_grad()
def _generate(model: Any, tokenizer: Any, prompts: list[list[int]], temperature: float,
              max_new_tokens: int, stopping: Any = None) -> list[str]:
    """Left-pad and generate a batch; returns the decoded replies (special tokens removed).

    The KV cache is preallocated (``cache_implementation="static"``): a growing cache
    re-concatenated every step was 70% of a batched step at 128 rows. Attention is transformers'
    own choice per call: for one new token it folds the query heads of each KV head into one
    query block (no copy of the cache), which on a CPU ran about 10x faster than torch's
    ``enable_gqa`` kernel (28 layers of a Qwen2.5 1.5B step at 32 rows and 600 cached tokens:
    4 ms against 42 ms per layer, one thread), so it is not forced (data.attention.native_gqa is
    for the decoder's multi-token forwards).
    ``stopping``: the criteria of :func:`stop_criteria` (built here when None)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):] = torch.tensor(p)
        attn[b, T - len(p):] = 1
    device = next(model.parameters()).device
    kw: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        kw.update(temperature=temperature, top_k=0, top_p=1.0)
    stops = stop_strings(tokenizer)
    stopping = stopping if stopping is not None else stop_criteria(tokenizer)
    if stopping is not None:
        kw["stopping_criteria"] = stopping
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                         max_new_tokens=max_new_tokens, pad_token_id=pad,
                         eos_token_id=tokenizer.eos_token_id, cache_implementation="static", **kw)
    return [cut_reply(tokenizer.decode(o[T:], skip_special_tokens=True), stops)
            for o in out.cpu()]


def stop_strings(tokenizer: Any) -> tuple[str, ...]:
    """Where a reply ends besides the end-of-sequence token: in the plain chat format of base
    models, at the next turn the model starts to invent (``PLAIN_STOP_STRINGS``); none else."""
    if getattr(tokenizer, "chat_template", None) == PLAIN_CHAT_TEMPLATE:
        return PLAIN_STOP_STRINGS
    return ()


def stop_criteria(tokenizer: Any) -> Any:
    """``StoppingCriteriaList`` of the tokenizer's :func:`stop_strings` (None without any).
    Built once per run: its tables span the whole vocabulary (a second for 262k tokens)."""
    stops = stop_strings(tokenizer)
    if not stops:
        return None
    from transformers import StoppingCriteriaList, StopStringCriteria

    return StoppingCriteriaList([StopStringCriteria(tokenizer, list(stops))])


def cut_reply(text: str, stops: Sequence[str] = ()) -> str:
    """``text`` up to its first stop string, without surrounding whitespace."""
    for stop in stops:
        text = text.split(stop, 1)[0]
    return text.strip()


def _regenerate_batch(model: Any, tokenizer: Any, convs: Sequence[Conversation],
                      temperature: float, max_new_tokens: int,
                      max_prompt_tokens: int, max_replies: int | None,
                      stopping: Any = None) -> list[Conversation]:
    new: list[list[dict[str, str]]] = [[] for _ in convs]
    active = [True] * len(convs)
    replies = [0] * len(convs)
    for i in range(max(len(c.messages) for c in convs)):
        todo, prompts = [], []
        for b, c in enumerate(convs):
            if not active[b] or i >= len(c.messages):
                continue
            msg = c.messages[i]
            if msg["role"] != "assistant":
                new[b].append(dict(msg))
                continue
            if not any(m["role"] == "user" for m in new[b]):
                continue  # a leading reply has no prompt to answer: dropped
            enc = tokenizer.apply_chat_template(new[b], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)
            if len(enc["input_ids"]) > max_prompt_tokens:
                active[b] = False  # too long: keep what is done so far
                continue
            todo.append(b)
            prompts.append(list(enc["input_ids"]))
        if prompts:
            for b, reply in zip(todo, _generate(model, tokenizer, prompts, temperature,
                                                max_new_tokens, stopping)):
                new[b].append({"role": "assistant", "content": reply})
                replies[b] += 1
                if max_replies is not None and replies[b] >= max_replies:
                    active[b] = False  # enough replies: the conversation ends here
    return [Conversation(id=c.id, messages=m) for c, m in zip(convs, new)]


def regenerate_conversations(conversations: Sequence[Conversation], target: Any,
                             out_path: str | Path, temperature: float = 0.0,
                             max_new_tokens: int = 256, batch_size: int = 8,
                             max_prompt_tokens: int = 1024,
                             max_replies: int | None = None, seed: int = 0,
                             progress: bool = True,
                             on_batch: Callable[[int], None] | None = None
                             ) -> list[Conversation]:
    """Replace every assistant turn by the target's own reply, resumably.

    Args:
        conversations: Input conversations (ids must be unique).
        target: `LoadedTarget` with ``model`` and ``tokenizer`` (chat template).
        out_path: Append-only jsonl of finished conversations ``{"id", "messages"}``.
        temperature: 0 for greedy decoding, else sampling temperature.
        max_new_tokens: Longest regenerated reply, in tokens.
        batch_size: Conversations generated together (left-padded).
        max_prompt_tokens: Stop regenerating a conversation once its prompt is longer.
        max_replies: Regenerate at most this many assistant turns per conversation (the
            conversation ends after the last one; None = all). One reply per conversation
            keeps every row of a batch busy; later turns run in ever smaller sub-batches.
        seed: Sampling seed (combined with the batch's first id, so a resumed run is reproducible).
        progress: Show a tqdm bar.
        on_batch: Called with the number of finished conversations after each batch.

    Returns:
        The regenerated conversations, in input order.
    """
    return regenerate_splits({"": (conversations, out_path)}, target, temperature=temperature,
                             max_new_tokens=max_new_tokens, batch_size=batch_size,
                             max_prompt_tokens=max_prompt_tokens, max_replies=max_replies,
                             seed=seed, progress=progress, on_batch=on_batch)[""]


def _record_line(conv: Conversation) -> str:
    return json.dumps({"id": conv.id, "messages": conv.messages}, ensure_ascii=False) + "\n"


def _take_reused(splits: Mapping[str, tuple[Sequence[Conversation], Any]],
                 paths: Mapping[str, Path], done: dict[str, dict[str, Conversation]],
                 reuse: Mapping[str, tuple[Conversation, Path]]) -> None:
    """Append each split's not yet finished conversations that ``reuse`` holds to the split's
    file (checked to answer the same requests first), as finished."""
    for name, (convs, _) in splits.items():
        taken = []
        for conv in convs:
            if conv.id in reuse and conv.id not in done[name]:
                record, folder = reuse[conv.id]
                check_same_requests(conv, record, folder)
                taken.append(record)
        if taken:
            with open(paths[name], "a", encoding="utf-8") as f:
                for record in taken:
                    f.write(_record_line(record))
                    done[name][record.id] = record
                f.flush()
                os.fsync(f.fileno())


def regenerate_splits(splits: Mapping[str, tuple[Sequence[Conversation], str | Path]],
                      target: Any, temperature: float = 0.0, max_new_tokens: int = 256,
                      batch_size: int = 8, max_prompt_tokens: int = 1024,
                      max_replies: int | None = None, seed: int = 0, progress: bool = True,
                      on_batch: Callable[[int], None] | None = None,
                      reuse: Mapping[str, tuple[Conversation, Path]] | None = None
                      ) -> dict[str, list[Conversation]]:
    """:func:`regenerate_conversations` for several splits at once, each with its own jsonl
    file: ``splits`` maps a split name to ``(conversations, out_path)``. The splits'
    conversations share length-bucketed batches, so a small split (a validation set of a few
    dozen) does not pay a whole batch of ``max_new_tokens`` steps for a few rows; each finished
    conversation is appended to its own split's file. ``on_batch`` gets the number finished in
    all splits. ``reuse`` maps ids to conversations an earlier run regenerated (and the folder
    each came from, :func:`draftsmith.data.regen_reuse.load_reused`): those are written to
    their split's file as they are instead of generated again. Returns each split's
    regenerated conversations, in input order."""
    if temperature < 0 or max_new_tokens < 1 or batch_size < 1:
        raise ValueError("need temperature >= 0, max_new_tokens >= 1 and batch_size >= 1; got "
                         f"{temperature}, {max_new_tokens}, {batch_size}")
    if max_replies is not None and max_replies < 1:
        raise ValueError(f"max_replies must be >= 1 or null (all turns); got {max_replies}")
    if target.tokenizer is None or not getattr(target.tokenizer, "chat_template", None):
        raise ValueError("regeneration needs the target's tokenizer with a chat format: load the "
                         "target with data.target.load_target, which gives a tokenizer without "
                         "a chat template the plain completion format (target.chat_template)")
    ids = [c.id for convs, _ in splits.values() for c in convs]
    if len(set(ids)) != len(ids):
        raise ValueError("conversation ids must be unique (across splits) for resumable "
                         "regeneration")
    paths = {name: Path(path) for name, (_, path) in splits.items()}
    if len(set(paths.values())) != len(paths):
        raise ValueError(f"each split needs its own output file, got {paths}")
    done: dict[str, dict[str, Conversation]] = {}
    for name, path in paths.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        done[name] = _load_done(path)
    if reuse:
        _take_reused(splits, paths, done, reuse)
    # length buckets: conversations whose first prompts have similar token lengths share a
    # batch (every row is padded to the batch's longest prompt, so one long prompt in a batch
    # of short ones multiplies its cost); the order depends on the inputs only, so a resumed run
    # forms the same remaining batches
    todo = [(name, c) for name, (convs, _) in splits.items() for c in convs
            if c.id not in done[name]]
    lengths = {c.id: _first_prompt_tokens(c.messages, target.tokenizer) for _, c in todo}
    todo.sort(key=lambda item: (lengths[item[1].id], item[1].id))
    model = target.model.eval()
    stopping = stop_criteria(target.tokenizer)
    bar = tqdm(total=len(ids), initial=len(ids) - len(todo), desc="regenerate", unit="conv",
               disable=not progress)
    with ExitStack() as stack:
        files = {name: stack.enter_context(open(path, "a", encoding="utf-8"))
                 for name, path in paths.items()}
        for s in range(0, len(todo), batch_size):
            batch = todo[s: s + batch_size]
            digest = hashlib.sha256(f"{seed}:{batch[0][1].id}".encode()).digest()
            torch.manual_seed(int.from_bytes(digest[:8], "little") % 2**63)
            convs = [c for _, c in batch]
            for (name, _), c in zip(batch, _regenerate_batch(
                    model, target.tokenizer, convs, temperature, max_new_tokens,
                    max_prompt_tokens, max_replies, stopping)):
                files[name].write(_record_line(c))
                done[name][c.id] = c
            for name in {name for name, _ in batch}:
                files[name].flush()
                os.fsync(files[name].fileno())
            bar.update(len(batch))
            if on_batch is not None:
                on_batch(sum(len(d) for d in done.values()))
    bar.close()
    return {name: [done[name][c.id] for c in convs] for name, (convs, _) in splits.items()}
