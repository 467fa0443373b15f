"""Decode prompts in llama.cpp's own ``llama-server``, plainly and with a GGUF draft, paired per
prompt; run with the ``llama_server`` environment's Python (this file needs the stdlib only).

    <engines>/llama_server/bin/python scripts/engine_runners/llama_server_run.py JOB RESULT

JOB.json: ``server`` (the llama-server binary), ``target`` (the target's GGUF), ``prompts``
(lists of token ids), ``max_tokens``, ``temperature``, ``seed``, ``max_model_len``, ``threads``
and ``runs``: ``[{"name", "draft" (a GGUF), "spec_type" (``draft-eagle3``, ``draft-dflash``,
``draft-simple``), "k", "sweep" (other draft lengths), "sweep_prompts"}, ...]``.

This llama-server takes its speculative settings at start-up only (the per-request
``speculative.*`` fields are compiled out), so a run keeps two servers loaded on the same
machine: the target alone, and the target with the draft (``--spec-draft-n-max k``,
``--spec-draft-p-min 0``: always k drafts, as our chain decoder at fixed K). After a warm-up
request on each, every prompt goes to the plain server, the speculative one and the plain one
again, so whatever the machine does meanwhile hits both sides of that prompt's ratio alike; each
request decodes the whole prompt afresh (``cache_prompt: false``). The draft length sweep
restarts only the speculative server for each other k and pairs the first ``sweep_prompts``
prompts the same way. Weights stay out of llama.cpp's repacked (AMX) buffers (``--no-repack``).

RESULT.json per run: the output ids per prompt (speculative; both plain runs), each prompt's
wall times and token counts, the summed ``timings.draft_n`` / ``draft_n_accepted`` of the
responses, the server's ``/metrics`` counters (verification steps, accepted tokens per draft
position) over the run, and the sweep's timings and counts per k; or the engine's error.
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

METRIC = re.compile(r'^llamacpp:(\w+)(?:\{position="(\d+)"\})?\s+([0-9.eE+-]+)$')
START_TIMEOUT_S = 300


class Server:
    """One llama-server process on a free local port; its log kept in a temporary file."""

    def __init__(self, job: dict, draft: str | None = None, spec_type: str | None = None,
                 k: int = 0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        threads = str(int(job.get("threads") or 2))
        cmd = [job["server"], "-m", job["target"], "--host", "127.0.0.1", "--port", str(self.port),
               "-c", str(int(job["max_model_len"])), "-t", threads, "-tb", threads, "-np", "1",
               "--no-repack", "--metrics", "--no-warmup", "--seed", str(int(job["seed"]))]
        if draft:
            cmd += ["-md", draft, "--spec-type", spec_type, "--spec-draft-n-max", str(int(k)),
                    "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", threads,
                    "-tbd", threads]
        self.cmd = cmd
        # the server's log, read back for errors; closed (and removed) in stop()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-",  # noqa: SIM115
                                               suffix=".log")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} at start-up: "
                                   f"{tail}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"llama-server not ready after {START_TIMEOUT_S} s: {tail}")
            time.sleep(0.2)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-n:]

    def complete(self, ids: list[int], job: dict, n_predict: int | None = None) -> dict:
        """One /completion request -> output ids, wall seconds, the response's timings."""
        temp = float(job["temperature"])
        body = {"prompt": [int(t) for t in ids], "n_predict": int(n_predict or job["max_tokens"]),
                "temperature": temp, "top_k": 1 if temp == 0 else 0, "top_p": 1.0, "min_p": 0.0,
                "repeat_penalty": 1.0, "seed": int(job["seed"]), "cache_prompt": False,
                "return_tokens": True, "stream": False}
        req = urllib.request.Request(self.url("/completion"), json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                res = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"llama-server answered {e.code}: {e.read()[:1000]!r}") from e
        wall = time.perf_counter() - t0
        return {"tokens": [int(t) for t in res.get("tokens", [])], "wall_s": wall,
                "timings": res.get("timings", {}), "stop_type": res.get("stop_type")}

    def metrics(self) -> dict:
        """The speculative counters of ``/metrics`` (cumulative over the server's life)."""
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as r:
            text = r.read().decode()
        out: dict = {"accepted_per_position": {}}
        for line in text.splitlines():
            m = METRIC.match(line.strip())
            if not m:
                continue
            name, pos, value = m.group(1), m.group(2), float(m.group(3))
            if pos is not None:
                out["accepted_per_position"][int(pos)] = int(value)
            elif name.startswith("spec_decode"):
                out[name] = int(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _counter_diff(after: dict, before: dict) -> dict:
    pos_a, pos_b = after.get("accepted_per_position", {}), before.get("accepted_per_position", {})
    n = max(pos_a, default=-1) + 1
    out = {k: v - before.get(k, 0) for k, v in after.items() if k != "accepted_per_position"}
    out["accepted_per_position"] = [pos_a.get(i, 0) - pos_b.get(i, 0) for i in range(n)]
    return out


def paired(plain: Server, spec: Server, prompts: list, job: dict) -> dict:
    """Per prompt: plain, speculative, plain again (after a warm-up request on each)."""
    for server in (plain, spec):
        server.complete(prompts[0], job, n_predict=8)
    before = spec.metrics()
    rows, outputs, plain_outputs = [], [], []
    draft_n = accepted = 0
    for ids in prompts:
        a = plain.complete(ids, job)
        s = spec.complete(ids, job)
        b = plain.complete(ids, job)
        rows.append({"plain_s": [a["wall_s"], b["wall_s"]],
                     "plain_tokens": [len(a["tokens"]), len(b["tokens"])],
                     "spec_s": s["wall_s"], "spec_tokens": len(s["tokens"]),
                     "stop_type": s["stop_type"]})
        outputs.append(s["tokens"])
        plain_outputs.append([a["tokens"], b["tokens"]])
        draft_n += int(s["timings"].get("draft_n", 0))
        accepted += int(s["timings"].get("draft_n_accepted", 0))
    return {"prompts": rows, "outputs": outputs, "plain_outputs": plain_outputs,
            "draft_n": draft_n, "draft_n_accepted": accepted,
            "metrics": _counter_diff(spec.metrics(), before)}


def run_one(job: dict, run: dict, plain: Server) -> dict:
    spec = Server(job, run["draft"], run["spec_type"], int(run["k"]))
    try:
        main = paired(plain, spec, job["prompts"], job)
    finally:
        spec.stop()
    sweep = []
    few = job["prompts"][:int(run.get("sweep_prompts") or len(job["prompts"]))]
    for k in run.get("sweep") or []:
        other = Server(job, run["draft"], run["spec_type"], int(k))
        try:
            res = paired(plain, other, few, job)
        finally:
            other.stop()
        sweep.append({"k": int(k), "prompts": res["prompts"], "draft_n": res["draft_n"],
                      "draft_n_accepted": res["draft_n_accepted"]})
    return {"name": run["name"], "ok": True, **main, "sweep": sweep,
            "spec": {"draft_n": main["draft_n"], "draft_n_accepted": main["draft_n_accepted"],
                     **main["metrics"]}}


def main() -> None:
    import sys

    job_path, out_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    version = "unknown"
    results = []
    try:
        done = subprocess.run([job["server"], "--version"], capture_output=True, text=True,
                              timeout=60, check=False)
        line = next((ln for ln in (done.stdout + done.stderr).splitlines()
                     if ln.startswith("version:")), "")
        version = "llama.cpp " + line.removeprefix("version:").strip() if line else version
        plain = Server(job)
    except Exception as e:  # noqa: BLE001 (the engine's own error is every run's result)
        results = [{"name": r["name"], "ok": False, "error": f"{type(e).__name__}: {e}"}
                   for r in job["runs"]]
    else:
        try:
            for run in job["runs"]:
                try:
                    results.append(run_one(job, run, plain))
                except Exception as e:  # noqa: BLE001
                    results.append({"name": run["name"], "ok": False,
                                    "error": f"{type(e).__name__}: {e}"})
        finally:
            plain.stop()
    with open(out_path, "w") as f:
        json.dump({"engine": "llama_server", "version": version, "runs": results}, f)


if __name__ == "__main__":
    main()
