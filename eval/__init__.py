"""draftsmith evaluation: verification, proposers, the speculative decoder, K*, sweeps and
reports."""
from pathlib import Path

# The evaluation tools' Hydra configs: conf/eval in a checkout, draftsmith/conf/eval in a wheel.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "eval"
