"""The ladder's figures: one definition for the simulated loss (``ladle plan``) and a measured one."""

from __future__ import annotations

import numpy as np

from ladle.service.schedule import ScheduleConfig, build_schedule
from ladle.service.schedule.stats import loss_figures, simulate_loss
from ladle.service.synth import production_lengths


def test_windows_std_and_streak() -> None:
    figures = loss_figures([0, 0, 1, 1, 1, 1, 0, 0, 5], window=2)  # the last, partial window is left out
    assert figures.windows == 4
    assert figures.windowed_std == 0.5
    assert figures.longest_above_mean_streak == 2


def test_flat_and_short_series() -> None:
    assert loss_figures(np.full(10, 3.0), window=2).longest_above_mean_streak == 0
    assert loss_figures(np.full(10, 3.0), window=2).windowed_std == 0.0
    empty = loss_figures([1.0], window=2)
    assert (empty.windows, empty.windowed_std, empty.longest_above_mean_streak) == (0, 0.0, 0)


def test_simulated_ladder_is_gone_with_stride() -> None:
    lengths = production_lengths(20_000, seed=0, scale=1 / 16)
    config = ScheduleConfig(max_seq_len=512, bucket_bounds=(0, 48, 76, 108, 152, 206, 513), token_budget=3072)
    ours = simulate_loss(build_schedule(lengths, config, world_size=2))
    naive = simulate_loss(build_schedule(lengths, config.replace(interleave="random"), world_size=2))
    assert ours.windowed_std < 0.6 * naive.windowed_std
    assert ours.longest_above_mean_streak < naive.longest_above_mean_streak
