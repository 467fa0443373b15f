"""draftsmith evaluation: the tools that load drafts, decode prompt sets, measure K* and tree
shapes, sweep and report; the speculative decoder they run lives in :mod:`eval.decoding`."""
from pathlib import Path

# The evaluation tools' Hydra configs: conf/eval in a checkout, draftsmith/conf/eval in a wheel.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "eval"
