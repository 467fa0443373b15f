"""The report's figures draw the data they are given: read back from the figures' artists."""
from __future__ import annotations

import pytest

from draftsmith.eval import plots


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """Keeps each figure (plots._save closes it) and returns {line label: (xs, ys)} per axes."""
    figures = []
    save = plots._save

    def keep(fig, path):
        figures.append(fig)
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)

    def lines(i: int = -1) -> list[dict]:
        return [{ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
                 for ln in ax.get_lines()} for ax in figures[i].axes]

    lines.figures = figures
    return lines


def test_acceptance_draws_served_and_trained_per_position(drawn, tmp_path):
    path = plots.plot_acceptance([plots.AcceptanceCurve("a T0", [0.6, 0.4, 0.3], [0.5, 0.45]),
                                  plots.AcceptanceCurve("b T1", [0.2])], tmp_path / "acc.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (ax,) = drawn()
    assert ax == {"a T0 served": ([1, 2, 3], [0.6, 0.4, 0.3]),
                  "a T0 trained": ([1, 2], [0.5, 0.45]),
                  "b T1 served": ([1], [0.2])}
    assert plots.plot_acceptance([plots.AcceptanceCurve("empty", [])], tmp_path / "n.png") is None


def test_speedup_vs_k_sorts_by_k_stars_the_best_and_dashes_the_prediction(drawn, tmp_path):
    s = plots.SpeedupSeries("lm", ks=[4, 1, 2], speedups=[1.1, 1.2, 1.4], best_k=2,
                            predicted_ks=[0, 1, 2, 4], predicted=[1.0, 1.25, 1.35, 1.15])
    plots.plot_speedup_vs_k([s], tmp_path / "sp.png")
    (ax,) = drawn()
    assert ax["lm measured"] == ([1, 2, 4], [1.2, 1.4, 1.1])
    assert ax["lm K*=2"] == ([2], [1.4])
    assert ax["lm predicted"] == ([0, 1, 2, 4], [1.0, 1.25, 1.35, 1.15])


def test_tau_per_category_bars_are_the_table(drawn, tmp_path):
    plots.plot_tau_per_category({"k1": {"code": 2.0, "chat": 1.5}, "k2": {"code": 2.5}},
                                tmp_path / "tau.png")
    (ax,) = drawn.figures[-1].axes
    heights = [round(p.get_height(), 6) for p in ax.patches]
    # categories sorted (chat, code); one bar group per job; a missing category draws 0
    assert heights == [1.5, 2.0, 0.0, 2.5]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["chat", "code"]


def test_training_curves_of_a_resumed_run_go_forward_in_steps(drawn, tmp_path):
    """A run resumed from its step-20 checkpoint logs steps 30 and 40 again: the curve keeps
    the later record of each step, in step order (not a line drawn back in time)."""
    log = [{"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.5}, {"step": 30, "loss": 2.4},
           {"step": 40, "loss": 2.3, "alpha_hat": [0.1, 0.05]},
           {"step": 30, "loss": 2.2}, {"step": 40, "loss": 2.1, "alpha_hat": [0.2, 0.1]},
           {"step": 50, "loss": 2.0, "alpha_hat": [0.3, 0.2]}]
    plots.plot_training_curves({"run": log}, tmp_path / "tc.png")
    loss_ax, alpha_ax = drawn()
    assert loss_ax == {"run": ([10, 20, 30, 40, 50], [3.0, 2.5, 2.2, 2.1, 2.0])}
    assert alpha_ax == {"run pos 1": ([40, 50], [0.2, 0.3]), "run pos 2": ([40, 50], [0.1, 0.2])}
